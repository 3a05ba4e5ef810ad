//! Configuration: read once, at start-up, into typed structs.
//!
//! Sources, later ones winning: the built-in defaults documented on each
//! field, the TOML file (`config/bloomgate.toml` unless `--config` says
//! otherwise), then environment variables `BLOOMGATE_<PATH>` where `__`
//! separates nesting levels (`BLOOMGATE_SERVER__LISTEN=0.0.0.0:8080`,
//! `BLOOMGATE_FILTER__FALSE_POSITIVE_RATE=0.001`). `DATABASE_URL`, when set,
//! overrides `database.url` (and `BLOOMGATE_DATABASE__URL` overrides both).
//! Unknown keys are errors, and every error names the key and its source.
//!
//! # Layout
//!
//! One file per section, each with its defaults and its own `validate`
//! naming the offending key: [`server`] (with [`cors`], its `[server.cors]`,
//! and [`cidr`], the networks `trusted_proxies` lists), [`admin`], [`database`], [`log`],
//! [`filter`], [`cache`], [`auth`], [`resource`] (a `[[resource]]`, its
//! overrides of `[filter]` and `[cache]`, and the [`Resolved`] form the
//! gateway runs). Beside them: [`env`] (the sources and their order, and
//! the refusal of misspelt variables), [`cache_control`] (the
//! `Cache-Control` grammar), [`route`] (the route grammar and the paths
//! the gateway keeps for itself, shared with `http::dispatch`) and
//! [`identifier`] (SQL identifiers and resource names). `reference`
//! (tests only) holds `config/bloomgate.toml` to the structs: every key in
//! its section, with the default the code uses.
//!
//! This module names nothing above it: the files `[auth]` points at are
//! read by `auth::key_files`, not at load.

pub mod admin;
pub mod auth;
pub mod bus;
pub mod cache;
pub mod cache_control;
pub mod cidr;
pub mod cors;
pub mod database;
pub mod env;
pub mod filter;
pub mod forms;
pub mod identifier;
pub mod log;
#[cfg(test)]
mod reference;
pub mod resource;
pub mod route;
pub mod server;

use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Format, Toml};
use serde::{Deserialize, Serialize};

pub use admin::{AdminConfig, MIN_TOKEN_LEN};
pub use auth::{
    Access, AuthConfig, AuthMode, MIN_JWT_SECRET, REDACTED, REDACTED_SECRET, RateLimit, parse_rate,
};
pub use bus::{BusConfig, BusReadFrom};
pub use cache::{CacheBound, CacheConfig, CacheOverrides, DEFAULT_MAX_BYTES};
pub use cidr::Cidr;
pub use cors::CorsConfig;
pub use database::{DatabaseConfig, Freshness, redact_url};
pub use filter::{FilterConfig, FilterOverrides};
pub use log::{FilteredRate, LogConfig, LogFormat};
pub use resource::{KeyPart, KeyType, MAX_KEY_PARTS, OneOrMany, Resolved, ResourceConfig};
pub use server::{DEFAULT_MAX_HEADERS, ForwardedHeader, ReadinessPolicy, ServerConfig};

/// The path used when `--config` is not given.
pub const DEFAULT_PATH: &str = "config/bloomgate.toml";

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub admin: AdminConfig,
    pub database: DatabaseConfig,
    pub log: LogConfig,
    /// Defaults for every resource's filter; each resource may override.
    pub filter: FilterConfig,
    /// Defaults for every resource's cache; each resource may override.
    pub cache: CacheConfig,
    /// Who may read what: token and key sources, shared by every resource
    /// whose `auth` is not `none` (see [`AuthConfig`]).
    pub auth: AuthConfig,
    /// The change stream a fleet shares (see [`BusConfig`]); unset, none.
    pub bus: BusConfig,
    /// The resources served, one `[[resource]]` table each.
    #[serde(rename = "resource")]
    pub resources: Vec<ResourceConfig>,
    /// Deprecated keys the file or environment used, one sentence each
    /// saying what replaces them: logged at start-up, printed by
    /// `check-config`.
    #[serde(skip)]
    pub deprecations: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The path as given, and where it was looked for (a relative path
    /// is resolved against the working directory, which a command run
    /// from elsewhere does not expect).
    #[error("config file {} not found (looked for {}; give another with --config PATH)", .0.display(), .1.display())]
    NotFound(PathBuf, PathBuf),
    /// Parse and type errors, naming the key and source (see
    /// [`LoadError`]).
    #[error("{}", LoadError(.0))]
    Load(Box<figment::Error>),
    #[error("{file}: {key}: {problem}")]
    Invalid {
        file: String,
        key: String,
        problem: String,
    },
}

/// A section's complaint about one of its keys, before the source is known.
#[derive(Debug, PartialEq)]
pub struct KeyProblem {
    /// The key as written in the file: `server.max_key_length`,
    /// `resource[0].filter.headroom`.
    pub key: String,
    pub problem: String,
}

impl KeyProblem {
    pub fn new(key: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            problem: problem.into(),
        }
    }

    /// The error, naming where the value came from.
    pub fn in_source(self, file: &str) -> ConfigError {
        ConfigError::Invalid {
            file: file.to_string(),
            key: self.key,
            problem: self.problem,
        }
    }
}

/// figment's errors as an operator reads them, in the shape every config
/// error has, `source: key: problem`: the file as given (or the
/// environment variable that was set), the key as written in the file
/// (`resource[0].table`, not figment's `default.resource.0.table`), and
/// the problem without nested quoting.
struct LoadError<'a>(&'a figment::Error);

impl std::fmt::Display for LoadError<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use figment::error::Kind;
        for (i, e) in self.0.clone().into_iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            let mut path: Vec<String> = e.path.clone();
            // A missing or repeated field is named with its container.
            match &e.kind {
                Kind::MissingField(name) => path.push(name.to_string()),
                Kind::DuplicateField(name) => path.push((*name).to_string()),
                _ => {}
            }
            let env = e
                .metadata
                .as_ref()
                .is_some_and(|md| md.source.is_none() && md.name.contains("environment"));
            let source = match e.metadata.as_ref().and_then(|md| md.source.as_ref()) {
                Some(figment::Source::File(p)) => p.display().to_string(),
                Some(other) => other.to_string(),
                None if env => format!(
                    "environment variable {}",
                    env::variable_for(&path.iter().map(String::as_str).collect::<Vec<_>>())
                ),
                None => e
                    .metadata
                    .as_ref()
                    .map_or("config".into(), |md| md.name.to_string()),
            };
            write!(f, "{source}: ")?;
            if !path.is_empty() {
                write!(f, "{}: ", file_key(&path))?;
            }
            let one_of = |names: &[&str]| match names {
                [] => String::new(),
                names => format!("; expected one of {}", names.join(", ")),
            };
            match &e.kind {
                Kind::Message(m) => write!(f, "{m}")?,
                Kind::InvalidType(actual, expected) | Kind::InvalidValue(actual, expected) => {
                    write!(f, "expected {expected}, found {actual}")?
                }
                Kind::InvalidLength(n, expected) => {
                    write!(f, "expected {expected}, found {n} items")?
                }
                Kind::UnknownVariant(v, names) => {
                    write!(f, "unknown value {v:?}{}", one_of(names))?
                }
                Kind::UnknownField(_, names) => write!(f, "unknown key{}", one_of(names))?,
                Kind::MissingField(_) => write!(f, "missing (it has no default)")?,
                Kind::DuplicateField(_) => write!(f, "set twice")?,
                other => write!(f, "{other}")?,
            }
        }
        Ok(())
    }
}

/// A figment path as the file writes it: `resource.0.table` is
/// `resource[0].table`.
fn file_key(path: &[String]) -> String {
    let mut out = String::new();
    for segment in path {
        if segment.chars().all(|c| c.is_ascii_digit()) && !out.is_empty() {
            out.push_str(&format!("[{segment}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(&segment.to_lowercase());
        }
    }
    out
}

impl Config {
    /// Reads the file at `path` and the environment.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        if !path.is_file() {
            let looked = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
            return Err(ConfigError::NotFound(path.to_path_buf(), looked));
        }
        let source = path.display().to_string();
        Self::from_figment(Figment::from(Toml::file_exact(path)), &source, true)
    }

    /// Parses TOML text alone, without the environment (tests, tools).
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Self::from_figment(Figment::from(Toml::string(text)), "config", false)
    }

    fn from_figment(file: Figment, source: &str, env: bool) -> Result<Self, ConfigError> {
        let mut config: Config = env::layered(file, env)?
            .extract()
            .map_err(|e| ConfigError::Load(Box::new(e)))?;
        if let Some(d) = (config.database.fold_aliases()).map_err(|p| p.in_source(source))? {
            config.deprecations.push(d);
        }
        config.validate().map_err(|p| p.in_source(source))?;
        Ok(config)
    }

    /// Every resource with overrides applied.
    pub fn resolved(&self) -> Vec<Resolved> {
        self.resources
            .iter()
            .map(|r| Resolved {
                name: r.name.clone(),
                route: r.route.clone(),
                table: r.table.clone(),
                source_table: r.source_table.clone().unwrap_or_else(|| r.table.clone()),
                key: r.key_parts(),
                columns: r.columns.clone(),
                filter: r.filter.apply(&self.filter),
                cache: r.cache.apply(&self.cache),
                access: r.access(),
            })
            .collect()
    }

    /// The effective config as TOML with secrets redacted.
    pub fn to_redacted_toml(&self) -> String {
        let mut c = self.clone();
        c.database.url = redact_url(&c.database.url);
        c.bus.url = c.bus.redacted_url();
        c.bus.sentinels = c.bus.redacted_sentinels();
        for u in &mut c.database.replica_urls {
            *u = redact_url(u);
        }
        if c.auth.jwt_secret.is_some() {
            // Still a valid secret of the same form, so the printed config
            // loads (`fuzz/config_parse`).
            c.auth.jwt_secret = Some(match c.auth.jwt_secret_base64 {
                true => {
                    use base64::Engine;
                    base64::engine::general_purpose::STANDARD.encode(REDACTED_SECRET)
                }
                false => REDACTED_SECRET.into(),
            });
        }
        // The budget that will be used, not its absence.
        if let CacheBound::Bytes(b) = c.cache.bound() {
            c.cache.max_bytes = Some(bytesize::ByteSize::b(b));
        }
        toml::to_string_pretty(&c).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    /// The keys whose values differ between `self` and `other`, dotted as
    /// in the file (`server.max_connections`, `resource[1].columns`), in
    /// file order. Secrets compare by value but only their keys are named,
    /// so the list may be logged.
    pub fn changed_keys(&self, other: &Config) -> Vec<String> {
        fn walk(
            path: &str,
            a: Option<&toml::Value>,
            b: Option<&toml::Value>,
            out: &mut Vec<String>,
        ) {
            use toml::Value;
            match (a, b) {
                (Some(Value::Table(a)), Some(Value::Table(b))) => {
                    let mut keys: Vec<&String> = a.keys().collect();
                    keys.extend(b.keys().filter(|k| !a.contains_key(*k)));
                    for k in keys {
                        let p = if path.is_empty() {
                            k.clone()
                        } else {
                            format!("{path}.{k}")
                        };
                        walk(&p, a.get(k), b.get(k), out);
                    }
                }
                (Some(Value::Array(a)), Some(Value::Array(b)))
                    if a.iter().chain(b).all(Value::is_table) =>
                {
                    for i in 0..a.len().max(b.len()) {
                        walk(&format!("{path}[{i}]"), a.get(i), b.get(i), out);
                    }
                }
                (a, b) if a != b => out.push(path.to_string()),
                _ => {}
            }
        }
        let (Ok(a), Ok(b)) = (toml::Value::try_from(self), toml::Value::try_from(other)) else {
            // Cannot happen for a config that loaded; never claim nothing changed.
            return vec!["the config (it could not be compared)".into()];
        };
        let mut out = Vec::new();
        walk("", Some(&a), Some(&b), &mut out);
        out
    }

    /// Each section in turn, then the resources against them; the first
    /// problem found is the error.
    fn validate(&self) -> Result<(), KeyProblem> {
        self.server.validate()?;
        self.admin.validate(&self.server)?;
        self.database.validate()?;
        self.log.validate()?;
        self.filter.validate("filter")?;
        self.cache.validate("cache")?;
        self.auth.validate()?;
        bus::validate(&self.bus, self.database.slot.as_deref())
            .map_err(|(key, problem)| KeyProblem { key, problem })?;
        resource::validate_all(&self.resources, &self.resolved(), &self.auth)?;
        self.server
            .cors
            .validate_against("server.cors", &self.resources)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use super::*;

    pub(crate) const MINIMAL: &str = r#"
        [[resource]]
        name = "users"
        route = "/users/{id}"
        table = "users"
        key_column = "id"
        key_type = "bigint"
        columns = ["id", "name"]
    "#;

    pub(crate) fn err(text: &str) -> String {
        Config::from_toml(text).unwrap_err().to_string()
    }

    /// What SIGHUP names as needing a restart: exactly the keys that
    /// differ, a secret by its key only, a resource by its index.
    #[test]
    fn changed_keys_name_what_differs_and_only_that() {
        let a = Config::from_toml(MINIMAL).unwrap();
        assert!(a.changed_keys(&a.clone()).is_empty());
        let secret = "s".repeat(40);
        let b = Config::from_toml(&format!(
            "[server]\nmax_connections = 5\n[auth]\njwt_secret = \"{secret}\"\n{MINIMAL}"
        ))
        .unwrap();
        let mut changed = a.changed_keys(&b);
        changed.sort();
        assert_eq!(changed, ["auth.jwt_secret", "server.max_connections"]);
        assert!(!format!("{changed:?}").contains(&secret));
        let c = Config::from_toml(&MINIMAL.replace("\"name\"]", "\"name\", \"email\"]")).unwrap();
        assert_eq!(a.changed_keys(&c), ["resource[0].columns"]);
        let two = format!("{MINIMAL}{}", MINIMAL.replace("users", "people"));
        let d = Config::from_toml(&two).unwrap();
        assert_eq!(a.changed_keys(&d), ["resource[1]"]);
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(c.server.max_key_length, 256);
        assert_eq!(c.filter.false_positive_rate, 0.01);
        let r = &c.resolved()[0];
        assert_eq!(r.filter, c.filter);
        assert_eq!(r.cache, c.cache);
    }

    #[test]
    fn overrides_apply_per_resource() {
        let text = format!(
            "{MINIMAL}\n[resource.filter]\nfalse_positive_rate = 0.001\nrebuild_interval = \"30s\"\n[resource.cache]\nttl = \"2m\"\n"
        );
        let c = Config::from_toml(&text).unwrap();
        let r = &c.resolved()[0];
        assert_eq!(r.filter.false_positive_rate, 0.001);
        assert_eq!(r.filter.rebuild_interval, Duration::from_secs(30));
        assert_eq!(r.filter.headroom, c.filter.headroom);
        assert_eq!(r.cache.ttl, Duration::from_secs(120));
        assert_eq!(r.cache.negative_ttl, c.cache.negative_ttl);
    }

    #[test]
    fn unknown_keys_are_errors_naming_the_key() {
        let e = err(&format!("[server]\nlisten_addr = \"x\"\n{MINIMAL}"));
        assert!(e.contains("listen_addr"), "{e}");
        let e = err(&MINIMAL.replace("columns", "colums"));
        assert!(e.contains("colums"), "{e}");
    }

    #[test]
    fn type_errors_name_the_key() {
        let e = err(&format!("[server]\nmax_key_length = \"long\"\n{MINIMAL}"));
        assert!(e.contains("max_key_length"), "{e}");
        let e = err(&format!("[filter]\nrebuild_interval = \"soon\"\n{MINIMAL}"));
        assert!(e.contains("rebuild_interval"), "{e}");
        let e = err(&MINIMAL.replace("\"bigint\"", "\"float\""));
        assert!(e.contains("key_type"), "{e}");
    }

    const ORDERS: &str = r#"
        [auth]
        jwt_secret = "0123456789abcdef0123456789abcdef"
        [[resource]]
        name = "orders"
        route = "/tenants/{tenant_id}/orders/{order_no}"
        table = "orders"
        key_column = ["tenant_id", "order_no"]
        key_type = ["bigint", "text"]
        columns = ["item"]
    "#;

    #[test]
    fn composite_keys_name_their_columns_in_the_route() {
        let c = Config::from_toml(ORDERS).unwrap();
        let r = &c.resolved()[0];
        assert_eq!(r.key_columns(), ["tenant_id", "order_no"]);
        assert_eq!(r.single_type(), None);
        assert_eq!(r.key_type_name(), "(bigint, text)");
        // One type for every column.
        let c = Config::from_toml(&ORDERS.replace(r#"["bigint", "text"]"#, r#""bigint""#)).unwrap();
        assert_eq!(c.resolved()[0].key[1].ty, KeyType::Bigint);
        for (from, to, field, problem) in [
            (
                r#"["bigint", "text"]"#,
                r#"["bigint"]"#,
                "key_type",
                "1 types for 2",
            ),
            (
                r#"["bigint", "text"]"#,
                r#"["bigint", "float"]"#,
                "key_type",
                "float",
            ),
            (
                r#""order_no"]"#,
                r#""tenant_id"]"#,
                "key_column",
                "named twice",
            ),
            (
                r#""order_no"]"#,
                r#""order-no"]"#,
                "key_column",
                "identifier",
            ),
            ("{order_no}", "{id}", "route", "no {order_no}"),
            ("/orders/{order_no}", "/orders", "route", "no {order_no}"),
            (
                "columns = [",
                "filter.mode = \"exact\"\ncolumns = [",
                "filter.mode",
                "single key_column",
            ),
            (
                "columns = [",
                "auth = \"jwt\"\nowner_claim = \"tenant\"\ncolumns = [",
                "owner_column",
                "composite key names no one owner",
            ),
        ] {
            let e = err(&ORDERS.replace(from, to));
            assert!(e.contains(&format!("resource[0].{field}")), "{to}: {e}");
            assert!(e.contains(problem), "{to}: {e}");
        }
        // The owner on a key part: compared with the key, before the filter.
        let c = Config::from_toml(&ORDERS.replace(
            "columns = [",
            "auth = \"jwt\"\nowner_claim = \"tenant\"\nowner_column = \"tenant_id\"\ncolumns = [",
        ))
        .unwrap();
        let a = &c.resolved()[0].access;
        assert_eq!(
            (a.owner_column.as_deref(), a.owner_key_part),
            (None, Some(0))
        );
    }

    #[test]
    fn sql_in_identifiers_is_refused() {
        for (field, value) in [
            ("table = \"users\"", "table = \"users; DROP TABLE users\""),
            ("key_column = \"id\"", "key_column = \"id\\\" OR 1=1 --\""),
            (
                "columns = [\"id\", \"name\"]",
                "columns = [\"id\", \"pg_sleep(10)\"]",
            ),
        ] {
            let e = err(&MINIMAL.replace(field, value));
            assert!(e.contains("not a valid SQL identifier"), "{e}");
            assert!(e.contains("resource[0]."), "{e}");
        }
        assert!(
            Config::from_toml(
                &MINIMAL.replace("\"users\"\n        key", "\"public.users\"\n        key")
            )
            .is_ok()
        );
    }

    #[test]
    fn missing_file_is_named() {
        let e = Config::load(Path::new("/nonexistent/bg.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/bg.toml"), "{e}");
    }

    /// Every error a file can cause reads `file: key: problem`, the key as
    /// the file writes it, with no nested quoting (figment's own form was
    /// "invalid type: found …, expected … for key "…" in … TOML file").
    #[test]
    fn load_errors_read_file_key_problem() {
        let dir = std::env::temp_dir().join(format!("bg-config-errors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.toml");
        let cases = [
            (
                format!("[server]\nmax_connections = 0\n{MINIMAL}"),
                "server.max_connections",
            ),
            (
                format!("[server]\nidle_timeout = \"abc\"\n{MINIMAL}"),
                "server.idle_timeout",
            ),
            (format!("[servr]\nx = 1\n{MINIMAL}"), "servr"),
            (
                MINIMAL.replace("\"bigint\"", "\"float\""),
                "resource[0].key_type",
            ),
            (
                MINIMAL.replace("key_column = \"id\"", ""),
                "resource[0].key_column",
            ),
            (MINIMAL.replace("columns", "colums"), "resource[0].colums"),
            (
                format!("[cache]\nmax_bytes = true\n{MINIMAL}"),
                "cache.max_bytes",
            ),
        ];
        for (text, key) in cases {
            std::fs::write(&path, &text).unwrap();
            let e = Config::load(&path).unwrap_err().to_string();
            let want = format!("{}: {key}: ", path.display());
            assert!(e.starts_with(&want), "{e:?} does not start with {want:?}");
            assert!(!e.contains('`') && !e.contains("TOML file"), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn no_resources_is_an_error() {
        assert!(err("").contains("[[resource]]"));
    }
}
