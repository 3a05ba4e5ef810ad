//! A resource's key columns and owner column as Postgres compares them
//! (`key::compare`), set once the catalog has been read
//! (`Gateway::resolve`), and the row query that compares each key part as
//! its column's own type.

use std::sync::Arc;

use super::Resource;
use crate::db::Queries;
use crate::error::Error;
use crate::key::compare::Comparison;
use crate::key::{self, Key, KeyType};

pub(super) struct KeyColumn {
    /// One per key column, in order.
    key: Box<[Comparison]>,
    owner: Comparison,
    /// The row query, the key cast to the column's base type where that
    /// compares otherwise than `text` does (`char(n)`, `citext`).
    row: Option<Arc<str>>,
}

const BYTES: Comparison = Comparison::Bytes;

impl Resource {
    /// How each key column (`key`, with its base type as SQL names it)
    /// and the owner column (`owner`) compare. The first call counts (the
    /// catalog is read again on a retried start, with the same result).
    pub fn set_columns(&self, key: Vec<(Comparison, String)>, owner: Comparison) {
        let mut special = false;
        let casts: Vec<String> = key
            .iter()
            .zip(&self.config.key)
            .map(|((cmp, base_sql), part)| match (cmp, part.ty) {
                (Comparison::Blank | Comparison::Lower(_), KeyType::Text) => {
                    special = true;
                    format!("text::{base_sql}")
                }
                _ => part.ty.sql_type().to_string(),
            })
            .collect();
        let row = special.then(|| {
            let key: Vec<(&str, &str)> = self
                .config
                .key
                .iter()
                .zip(&casts)
                .map(|(p, cast)| (p.column.as_str(), cast.as_str()))
                .collect();
            Arc::from(Queries::row_query(
                &self.config.table,
                &key,
                &self.config.columns,
            ))
        });
        let key = key.into_iter().map(|(cmp, _)| cmp).collect();
        let _ = self.column.set(KeyColumn { key, owner, row });
    }

    /// How the (first) key column compares (bytes until the catalog is
    /// read).
    pub fn comparison(&self) -> &Comparison {
        self.part_comparison(0)
    }

    /// How key column `i` compares (bytes until the catalog is read).
    pub fn part_comparison(&self, i: usize) -> &Comparison {
        self.column
            .get()
            .and_then(|c| c.key.get(i))
            .unwrap_or(&BYTES)
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
        match &key {
            Key::Text(_) => match self.column.get() {
                Some(c) => Ok(c.key[0].key(key)),
                None => Err(Error::NotReady),
            },
            Key::Tuple(t) if t.parts().iter().any(|p| matches!(p, Key::Text(_))) => {
                match self.column.get() {
                    Some(c) if c.key.iter().all(|c| matches!(c, Comparison::Bytes)) => Ok(key),
                    Some(c) => Ok(Key::tuple(
                        t.parts()
                            .iter()
                            .zip(&c.key)
                            .map(|(p, cmp)| cmp.key(p.clone()))
                            .collect(),
                    )),
                    None => Err(Error::NotReady),
                }
            }
            _ => Ok(key),
        }
    }

    /// A key as a feed announces it: each part's text
    /// (`key::from_db_text`), canonical. `None` if a part cannot be one.
    pub fn key_from_db(&self, parts: &[&str]) -> Option<Key> {
        if let ([text], [part]) = (parts, &*self.config.key) {
            return key::from_db_text(text, part.ty).map(|k| self.comparison().key(k));
        }
        let keys = parts
            .iter()
            .zip(&self.config.key)
            .enumerate()
            .map(|(i, (text, part))| {
                key::from_db_text(text, part.ty).map(|k| self.part_comparison(i).key(k))
            })
            .collect::<Option<Vec<Key>>>()?;
        (keys.len() == self.config.key.len()).then(|| Key::tuple(keys))
    }
}
