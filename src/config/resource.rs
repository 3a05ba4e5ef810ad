//! `[[resource]]`: one table served by key, its overrides of `[filter]`
//! and `[cache]`, its access rules, and what it resolves to
//! ([`Resolved`]). Each resource is checked on its own here; what they must
//! not share (names, routes) and how many scopes and owner claims they may
//! use together is checked over all of them.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use super::KeyProblem;
use super::auth::{self, Access, AuthConfig, AuthMode, RateLimit, parse_rate};
use super::cache::{CacheConfig, CacheOverrides};
use super::filter::{FilterConfig, FilterOverrides};
use super::identifier::{is_identifier, is_name, is_table};
use super::route;
use crate::filter::Mode;

/// The SQL type of a resource's key column. What each type accepts and
/// how its keys are parsed is `key`'s business; it is declared here so the
/// configuration stays below every module that reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyType {
    /// `bigint` (`int8`); `integer` and `smallint` columns work too, since
    /// every value they hold is a valid `bigint`.
    Bigint,
    /// `uuid`, written hyphenated or as 32 hex digits, any case.
    Uuid,
    /// `text` / `varchar`: any UTF-8 string without control characters.
    Text,
}

/// Parts a composite key may have at most.
pub const MAX_KEY_PARTS: usize = 8;

/// A value written alone or as an array (`key_column`, `key_type`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

/// A string is read as `T` reads one, so that a bad value's error is
/// `T`'s own ("unknown variant `float`, expected one of ...").
impl<'de, T: Deserialize<'de>> Deserialize<'de> for OneOrMany<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Visit<T> {
            type Value = OneOrMany<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or an array of strings")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                T::deserialize(serde::de::value::StrDeserializer::new(v)).map(OneOrMany::One)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> Result<Self::Value, A::Error> {
                Vec::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
                    .map(OneOrMany::Many)
            }
        }
        d.deserialize_any(Visit(std::marker::PhantomData))
    }
}

impl<T> OneOrMany<T> {
    pub fn as_slice(&self) -> &[T] {
        match self {
            OneOrMany::One(v) => std::slice::from_ref(v),
            OneOrMany::Many(v) => v,
        }
    }
}

/// One column of a resource's key, and its type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KeyPart {
    pub column: String,
    pub ty: KeyType,
}

/// One `[[resource]]`: a table served by key.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceConfig {
    /// Unique name, used in logs, metrics and the admin API.
    pub name: String,
    /// Route with one `{param}` for the key, e.g. `/users/{id}`.
    pub route: String,
    /// Table or view, optionally schema-qualified (`public.users`).
    pub table: String,
    /// The table whose changes this resource follows, when `table` is a view
    /// (triggers and logical replication see tables only): its key column
    /// must have the same name and values there. Default: `table` itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_table: Option<String>,
    /// Column holding the key, or the columns of a composite key
    /// (`["tenant_id", "order_no"]`, at most [`MAX_KEY_PARTS`], each a
    /// `{column}` of `route`). The key must be unique: the table's primary
    /// key, or a valid, non-partial unique index within these columns
    /// (start-up refuses a table without one; see
    /// `db::catalog::TableInfo::uniqueness`).
    pub key_column: OneOrMany<String>,
    /// `bigint`, `uuid` or `text`; for a composite key one per column in
    /// the same order, or one for every column.
    pub key_type: OneOrMany<KeyType>,
    /// Columns returned as the JSON object, in order.
    pub columns: Vec<String>,
    /// Per-resource overrides of `[filter]`.
    #[serde(default)]
    pub filter: FilterOverrides,
    /// Per-resource overrides of `[cache]`.
    #[serde(default)]
    pub cache: CacheOverrides,
    /// Who may read this resource: `none` (anyone, the default), `jwt` (a
    /// bearer JWT), `api_key` (an `X-API-Key` from `auth.api_keys_file`)
    /// or `any` (either).
    #[serde(default, skip_serializing_if = "AuthMode::is_none")]
    pub auth: AuthMode,
    /// Scopes the caller must hold, all of them (a JWT's `auth.scope_claim`,
    /// an API key's `scopes`). Default none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<String>,
    /// A JWT claim (`sub`, say) naming the only row the caller may read:
    /// the one whose key, or `owner_column`, equals the claim's value.
    /// Another owner's row is answered 404, exactly as an absent key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_claim: Option<String>,
    /// The column `owner_claim` is compared with, read from the cached row
    /// (so it must be one of `columns`). Default: the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_column: Option<String>,
    /// Requests per caller (`"20/s"`, `"600/m"`, `"10000/h"`): the token's
    /// `sub` or the API key's name, else the client address (an IPv6
    /// address by its /64). Past it: 429. Default: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<String>,
    /// Requests a caller may send at once above the rate, after a pause.
    /// Default: one second's worth of `rate_limit` (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit_burst: Option<u32>,
}

/// A resource with its overrides applied: what the gateway runs.
#[derive(Clone, Debug, Serialize)]
pub struct Resolved {
    pub name: String,
    pub route: String,
    pub table: String,
    /// `source_table`, or `table` when not set.
    pub source_table: String,
    /// The key's columns in `key_column` order: one, or a composite key's.
    pub key: Vec<KeyPart>,
    pub columns: Vec<String>,
    pub filter: FilterConfig,
    pub cache: CacheConfig,
    pub access: Access,
}

impl Resolved {
    /// The key's type when it has one column.
    pub fn single_type(&self) -> Option<KeyType> {
        match self.key.as_slice() {
            [one] => Some(one.ty),
            _ => None,
        }
    }

    /// The key's columns, in order.
    pub fn key_columns(&self) -> Vec<&str> {
        self.key.iter().map(|p| p.column.as_str()).collect()
    }

    /// The key's types as the admin API and logs show them
    /// (`bigint`, or `(bigint, text)`).
    pub fn key_type_name(&self) -> String {
        match self.key.as_slice() {
            [one] => one.ty.sql_type().into(),
            parts => format!(
                "({})",
                parts
                    .iter()
                    .map(|p| p.ty.sql_type())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

impl ResourceConfig {
    /// The key's parts: `key_column` with `key_type`, which the
    /// validation has checked agree in number.
    pub(super) fn key_parts(&self) -> Vec<KeyPart> {
        let types = self.key_type.as_slice();
        self.key_column
            .as_slice()
            .iter()
            .enumerate()
            .map(|(i, column)| KeyPart {
                column: column.clone(),
                ty: types
                    .get(i)
                    .or(types.first())
                    .copied()
                    .unwrap_or(KeyType::Text),
            })
            .collect()
    }

    /// The access rules; `rate_limit` unparsable reads as none here (the
    /// config was validated before anything calls this).
    pub(super) fn access(&self) -> Access {
        let owner_column = self
            .owner_column
            .clone()
            .filter(|c| self.owner_claim.is_some() && !self.key_column.as_slice().contains(c));
        Access {
            mode: self.auth,
            scopes: self.scopes.clone(),
            owner_claim: self.owner_claim.clone(),
            owner_column,
            owner_key_part: match self.key_column.as_slice() {
                [_] => None,
                key => self
                    .owner_column
                    .as_ref()
                    .filter(|_| self.owner_claim.is_some())
                    .and_then(|c| key.iter().position(|k| k == c)),
            },
            rate_limit: self
                .rate_limit
                .as_deref()
                .and_then(|r| parse_rate(r).ok())
                .map(|per_second| RateLimit {
                    per_second,
                    burst: self
                        .rate_limit_burst
                        .unwrap_or((per_second.ceil() as u32).max(1)),
                }),
        }
    }
}

/// Checks every resource, `resolved` being each one with its overrides
/// applied, in order; the first problem is returned.
pub(super) fn validate_all(
    resources: &[ResourceConfig],
    resolved: &[Resolved],
    auth: &AuthConfig,
) -> Result<(), KeyProblem> {
    if resources.is_empty() {
        return Err(KeyProblem::new(
            "resource",
            "at least one [[resource]] is required",
        ));
    }
    let mut names = HashSet::new();
    let mut routes = HashSet::new();
    for (i, (r, res)) in resources.iter().zip(resolved).enumerate() {
        let at = |field: &str| format!("resource[{i}].{field}");
        if !is_name(&r.name) {
            return Err(KeyProblem::new(
                at("name"),
                format!("{:?} must be 1-63 letters, digits, '_' or '-'", r.name),
            ));
        }
        if !names.insert(&r.name) {
            return Err(KeyProblem::new(
                at("name"),
                format!("{:?} is used twice", r.name),
            ));
        }
        r.validate_key(i)?;
        route::check(&r.route, &res.key_columns()).map_err(|p| KeyProblem::new(at("route"), p))?;
        if !routes.insert(route::shape(&r.route)) {
            return Err(KeyProblem::new(
                at("route"),
                format!("{:?} clashes with another resource", r.route),
            ));
        }
        r.validate(i, res, auth)?;
    }
    let scopes: HashSet<&String> = resources.iter().flat_map(|r| &r.scopes).collect();
    if scopes.len() > auth::MAX_SCOPES {
        return Err(KeyProblem::new(
            "resource[].scopes",
            format!(
                "{} distinct scopes; at most {} are supported",
                scopes.len(),
                auth::MAX_SCOPES
            ),
        ));
    }
    let claims: HashSet<&String> = resources
        .iter()
        .filter_map(|r| r.owner_claim.as_ref())
        .collect();
    if claims.len() > auth::MAX_OWNER_CLAIMS {
        return Err(KeyProblem::new(
            "resource[].owner_claim",
            format!(
                "{} distinct owner claims; at most {} are supported",
                claims.len(),
                auth::MAX_OWNER_CLAIMS
            ),
        ));
    }
    Ok(())
}

impl ResourceConfig {
    /// What this resource alone must satisfy: `i` is its place in the file,
    /// `res` its resolved form, `auth` the `[auth]` its rules rely on.
    fn validate(&self, i: usize, res: &Resolved, auth: &AuthConfig) -> Result<(), KeyProblem> {
        let at = |field: &str| format!("resource[{i}].{field}");
        if !is_table(&self.table) {
            return Err(KeyProblem::new(
                at("table"),
                format!(
                    "{:?} is not a valid SQL identifier (letters, digits, '_', optionally schema.table)",
                    self.table
                ),
            ));
        }
        if let Some(t) = &self.source_table
            && !is_table(t)
        {
            return Err(KeyProblem::new(
                at("source_table"),
                format!("{t:?} is not a valid SQL identifier (optionally schema.table)"),
            ));
        }
        if self.columns.is_empty() {
            return Err(KeyProblem::new(
                at("columns"),
                "must name at least one column",
            ));
        }
        if let Some(c) = self.columns.iter().find(|c| !is_identifier(c)) {
            return Err(KeyProblem::new(
                at("columns"),
                format!("{c:?} is not a valid SQL identifier"),
            ));
        }
        res.filter.validate(&at("filter"))?;
        res.cache.validate(&at("cache"))?;
        self.validate_access(auth)
            .map_err(|(field, problem)| KeyProblem::new(at(field), problem))?;
        if self.auth != AuthMode::None {
            for (field, value) in [
                ("http_cache_control", &res.cache.http_cache_control),
                (
                    "http_cache_control_not_found",
                    &res.cache.http_cache_control_not_found,
                ),
            ] {
                if value
                    .split(',')
                    .any(|d| d.trim().eq_ignore_ascii_case("public"))
                {
                    return Err(KeyProblem::new(
                        at(&format!("cache.{field}")),
                        "\"public\" would let a shared cache keep one caller's answer for \
                         others; a resource with auth is sent private",
                    ));
                }
            }
        }
        if res.filter.mode == Mode::Exact && res.single_type() != Some(KeyType::Bigint) {
            return Err(KeyProblem::new(
                at("filter.mode"),
                "`exact` needs a single key_column with key_type = \"bigint\"; use `bloom` or `auto`",
            ));
        }
        Ok(())
    }

    /// `key_column` and `key_type`: identifiers, distinct, at most
    /// [`MAX_KEY_PARTS`], and one type per column or one for all.
    fn validate_key(&self, i: usize) -> Result<(), KeyProblem> {
        let at = |field: &str| format!("resource[{i}].{field}");
        let columns = self.key_column.as_slice();
        if columns.is_empty() || columns.len() > MAX_KEY_PARTS {
            return Err(KeyProblem::new(
                at("key_column"),
                format!("must name 1 to {MAX_KEY_PARTS} columns"),
            ));
        }
        if let Some(c) = columns.iter().find(|c| !is_identifier(c)) {
            return Err(KeyProblem::new(
                at("key_column"),
                format!("{c:?} is not a valid SQL identifier"),
            ));
        }
        if let Some(c) = columns
            .iter()
            .enumerate()
            .find(|(j, c)| columns[..*j].contains(c))
            .map(|(_, c)| c)
        {
            return Err(KeyProblem::new(
                at("key_column"),
                format!("{c:?} is named twice"),
            ));
        }
        if let OneOrMany::Many(types) = &self.key_type
            && types.len() != columns.len()
        {
            let types = types.len();
            return Err(KeyProblem::new(
                at("key_type"),
                format!(
                    "{types} types for {} key columns: give one type per column, in key_column order, or one string for all",
                    columns.len()
                ),
            ));
        }
        Ok(())
    }

    /// The access rules against `[auth]`: each mode has its source, the
    /// rules that need a caller have one. The error is (field, problem).
    fn validate_access(&self, a: &AuthConfig) -> Result<(), (&'static str, String)> {
        match self.auth {
            AuthMode::Jwt if !a.has_jwt() => {
                return Err((
                    "auth",
                    "\"jwt\" needs auth.jwt_secret, auth.jwks_file or auth.jwks_url".into(),
                ));
            }
            AuthMode::ApiKey if !a.has_api_keys() => {
                return Err(("auth", "\"api_key\" needs auth.api_keys_file".into()));
            }
            AuthMode::Any if !a.has_jwt() && !a.has_api_keys() => {
                return Err((
                    "auth",
                    "\"any\" needs a token source (auth.jwt_secret, auth.jwks_file, auth.jwks_url) or auth.api_keys_file".into(),
                ));
            }
            _ => {}
        }
        if self.auth == AuthMode::None {
            for (field, set) in [
                ("scopes", !self.scopes.is_empty()),
                ("owner_claim", self.owner_claim.is_some()),
            ] {
                if set {
                    return Err((
                        field,
                        "needs a caller: set auth to \"jwt\", \"api_key\" or \"any\"".into(),
                    ));
                }
            }
        }
        if let Some(s) = self.scopes.iter().find(|s| !auth::is_scope(s)) {
            return Err((
                "scopes",
                format!(
                    "{s:?} is not a scope (printable ASCII without space, '\"' or '\\', at most 128)"
                ),
            ));
        }
        if let Some(c) = &self.owner_claim {
            if self.auth == AuthMode::ApiKey {
                return Err((
                    "owner_claim",
                    "API keys carry no claims: use auth = \"jwt\" or \"any\"".into(),
                ));
            }
            auth::check_claim(c).map_err(|p| ("owner_claim", p))?;
        }
        if self.owner_claim.is_some()
            && self.owner_column.is_none()
            && self.key_column.as_slice().len() > 1
        {
            return Err((
                "owner_column",
                "a composite key names no one owner: set owner_column to the key part (or \
                 the column) that holds it"
                    .into(),
            ));
        }
        if let Some(c) = &self.owner_column {
            if self.owner_claim.is_none() {
                return Err(("owner_column", "needs owner_claim".into()));
            }
            if !self.key_column.as_slice().contains(c) && !self.columns.contains(c) {
                return Err((
                    "owner_column",
                    format!(
                        "{c:?} must be a key column or one of columns: the check reads it from the key or the cached row"
                    ),
                ));
            }
        }
        match (&self.rate_limit, self.rate_limit_burst) {
            (Some(rate), burst) => {
                parse_rate(rate).map_err(|p| ("rate_limit", p))?;
                if burst.is_some_and(|b| b == 0 || b > 1_000_000) {
                    return Err(("rate_limit_burst", "must be between 1 and 1000000".into()));
                }
            }
            (None, Some(_)) => return Err(("rate_limit_burst", "needs rate_limit".into())),
            (None, None) => {}
        }
        Ok(())
    }
}
