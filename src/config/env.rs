//! Where a setting comes from, later sources winning: the built-in
//! defaults, the TOML file, `DATABASE_URL` (for `database.url`), then
//! `BLOOMGATE_<SECTION>__<KEY>` variables; and the refusal of a variable
//! that looks like a setting but would be ignored, or that names a
//! resource (`[[resource]]` is set only in the file).

use figment::Figment;
use figment::providers::{Env, Serialized};

use super::{Config, ConfigError};

/// The defaults, then `file`, then (when `env`) the environment.
pub(super) fn layered(file: Figment, env: bool) -> Result<Figment, ConfigError> {
    let mut fig = Figment::from(Serialized::defaults(Config::default())).merge(file);
    if !env {
        return Ok(fig);
    }
    if let Ok(url) = std::env::var("DATABASE_URL") {
        fig = fig.merge(Serialized::default("database.url", url));
    }
    check_typos()?;
    check_resources()?;
    // Every key settable from the environment is `SECTION__KEY`. A variable
    // without `__` is not a config path (the admin token, the scripts' own
    // BLOOMGATE_PG_PORT, ...), so it is left alone.
    Ok(fig.merge(
        Env::prefixed("BLOOMGATE_")
            .filter(|k| k.as_str().contains("__"))
            .split("__"),
    ))
}

/// The variable that sets the config key `path` (`["server", "listen"]`:
/// `BLOOMGATE_SERVER__LISTEN`), for errors about a value it gave.
pub fn variable_for(path: &[&str]) -> String {
    let upper: Vec<String> = path.iter().map(|p| p.to_uppercase()).collect();
    format!("BLOOMGATE_{}", upper.join("__"))
}

/// The sections a variable can name: the tables of [`Config`] (not the
/// `[[resource]]` array, which the environment cannot set).
fn sections() -> Vec<String> {
    match toml::Value::try_from(Config::default()) {
        Ok(toml::Value::Table(t)) => t
            .into_iter()
            .filter(|(_, v)| v.is_table())
            .map(|(k, _)| k)
            .collect(),
        _ => Vec::new(),
    }
}

/// `BLOOMGATE_SERVER_LISTEN` (one underscore) looks like a config key but
/// would be ignored: refuse it rather than run with the file's value.
fn check_typos() -> Result<(), ConfigError> {
    let sections = sections();
    for (name, _) in std::env::vars_os() {
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("BLOOMGATE_")) else {
            continue;
        };
        let lower = rest.to_ascii_lowercase();
        if lower.contains("__") || lower == "admin_token" {
            continue;
        }
        if let Some(section) = sections.iter().find(|s| {
            lower
                .strip_prefix(s.as_str())
                .is_some_and(|r| r.starts_with('_'))
        }) {
            let key = &lower[section.len() + 1..];
            return Err(ConfigError::Invalid {
                file: "environment".into(),
                key: format!("BLOOMGATE_{rest}"),
                problem: format!(
                    "sections and keys are separated by two underscores: BLOOMGATE_{}__{}",
                    section.to_ascii_uppercase(),
                    key.to_ascii_uppercase()
                ),
            });
        }
    }
    Ok(())
}

/// `BLOOMGATE_RESOURCE__0__NAME`: the environment cannot set a resource
/// (figment would read it as a table where the file has an array of them,
/// and say only "expected a sequence, found map"): refuse it, saying where
/// resources are set.
fn check_resources() -> Result<(), ConfigError> {
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else {
            continue;
        };
        let Some(rest) = name.strip_prefix("BLOOMGATE_") else {
            continue;
        };
        let section = rest.split("__").next().unwrap_or_default();
        if rest.contains("__") && section.eq_ignore_ascii_case("resource") {
            return Err(ConfigError::Invalid {
                file: "environment".into(),
                key: name.to_string(),
                problem: "resources ([[resource]]) are set only in the config file, not from the environment: unset it".into(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::tests::MINIMAL;

    #[test]
    fn every_table_of_the_config_is_a_section() {
        let mut s = sections();
        s.sort();
        for want in [
            "admin", "auth", "cache", "database", "filter", "log", "server",
        ] {
            assert!(s.iter().any(|x| x == want), "{want} in {s:?}");
        }
        assert!(!s.iter().any(|x| x == "resource"), "{s:?}");
    }

    /// `BLOOMGATE_DATABASE__REPLICA_URLS` as a TOML array, as one URL and as
    /// comma-separated URLs: figment's environment provider hands the
    /// latter two over as plain strings.
    #[test]
    fn replica_urls_from_the_environment_take_an_array_or_plain_text() {
        let both = ["postgres://u:p@a:5432/db", "postgres://b/db"];
        for (text, want) in [
            (format!("[\"{}\", \"{}\"]", both[0], both[1]), &both[..]),
            (format!("{},{}", both[0], both[1]), &both[..]),
            (format!(" {} ", both[0]), &both[..1]),
        ] {
            // A prefix of its own: nothing else reads these variables.
            #[allow(clippy::result_large_err)] // figment's Jail signature
            figment::Jail::expect_with(|jail| {
                jail.set_env("BGTEST_DATABASE__REPLICA_URLS", &text);
                let fig = Figment::from(Serialized::defaults(Config::default()))
                    .merge(Env::prefixed("BGTEST_").split("__"));
                let c: Config = fig.extract()?;
                assert_eq!(c.database.replica_urls, want, "{text}");
                Ok(())
            });
        }
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns its own error
    fn environment_overrides_the_file() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("bg.toml", MINIMAL)?;
            jail.set_env("BLOOMGATE_SERVER__LISTEN", "0.0.0.0:9999");
            jail.set_env("BLOOMGATE_FILTER__FALSE_POSITIVE_RATE", "0.001");
            jail.set_env("DATABASE_URL", "postgres://a:pw@h/db");
            jail.set_env("BLOOMGATE_ADMIN_TOKEN", "not-a-config-key");
            let c = Config::load(Path::new("bg.toml")).map_err(|e| e.to_string())?;
            assert_eq!(c.server.listen.port(), 9999);
            assert_eq!(c.resolved()[0].filter.false_positive_rate, 0.001);
            assert_eq!(c.database.url, "postgres://a:pw@h/db");
            jail.set_env("BLOOMGATE_DATABASE__URL", "postgres://h2/db");
            assert_eq!(
                Config::load(Path::new("bg.toml")).unwrap().database.url,
                "postgres://h2/db"
            );
            // The scripts' and tests' own variables are not config keys.
            jail.set_env("BLOOMGATE_TEST_DATABASE_URL", "postgres://x/y");
            jail.set_env("BLOOMGATE_PG_PORT", "54329");
            assert!(Config::load(Path::new("bg.toml")).is_ok());
            jail.set_env("BLOOMGATE_SERVER__NOPE", "1");
            let e = Config::load(Path::new("bg.toml")).unwrap_err().to_string();
            assert!(e.contains("nope") && e.contains("BLOOMGATE_"), "{e}");
            // A one-underscore typo is refused with the right spelling
            // (Jail restores the environment afterwards).
            jail.set_env("BLOOMGATE_SERVER__NOPE", "");
            jail.set_env("BLOOMGATE_SERVER_LISTEN", "0.0.0.0:1");
            let e = Config::load(Path::new("bg.toml")).unwrap_err().to_string();
            assert!(e.contains("BLOOMGATE_SERVER__LISTEN"), "{e}");
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns its own error
    fn a_resource_from_the_environment_is_refused_saying_where_resources_are_set() {
        for name in [
            "BLOOMGATE_RESOURCE__0__NAME",
            "BLOOMGATE_resource__users__ROUTE",
        ] {
            figment::Jail::expect_with(|jail| {
                jail.create_file("bg.toml", MINIMAL)?;
                jail.set_env(name, "x");
                let e = Config::load(Path::new("bg.toml")).unwrap_err().to_string();
                assert!(e.contains(name), "{e}");
                assert!(e.contains("set only in the config file"), "{e}");
                assert!(!e.contains("expected a sequence"), "{e}");
                Ok(())
            });
        }
    }
}
