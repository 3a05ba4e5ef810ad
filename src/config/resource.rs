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
    /// Column holding the key. It must be unique: the table's primary key,
    /// or a valid, non-partial unique index on it (start-up refuses a
    /// table without one; see `db::catalog::TableInfo::uniqueness`).
    pub key_column: String,
    /// `bigint`, `uuid` or `text`.
    pub key_type: KeyType,
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
    pub key_column: String,
    pub key_type: KeyType,
    pub columns: Vec<String>,
    pub filter: FilterConfig,
    pub cache: CacheConfig,
    pub access: Access,
}

impl ResourceConfig {
    /// The access rules; `rate_limit` unparsable reads as none here (the
    /// config was validated before anything calls this).
    pub(super) fn access(&self) -> Access {
        let owner_column = self
            .owner_column
            .clone()
            .filter(|c| *c != self.key_column && self.owner_claim.is_some());
        Access {
            mode: self.auth,
            scopes: self.scopes.clone(),
            owner_claim: self.owner_claim.clone(),
            owner_column,
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
        route::check(&r.route).map_err(|p| KeyProblem::new(at("route"), p))?;
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
        if !is_identifier(&self.key_column) {
            return Err(KeyProblem::new(
                at("key_column"),
                format!("{:?} is not a valid SQL identifier", self.key_column),
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
        if res.filter.mode == Mode::Exact && self.key_type != KeyType::Bigint {
            return Err(KeyProblem::new(
                at("filter.mode"),
                "`exact` needs key_type = \"bigint\"; use `bloom` or `auto`",
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
        if let Some(c) = &self.owner_column {
            if self.owner_claim.is_none() {
                return Err(("owner_column", "needs owner_claim".into()));
            }
            if *c != self.key_column && !self.columns.contains(c) {
                return Err((
                    "owner_column",
                    format!("{c:?} must be one of columns: the check reads it from the cached row"),
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
