//! The files `[auth]` names, read and checked once at start-up, right
//! after the configuration (so `check-config` checks them too): the JWK Set
//! of `auth.jwks_file` and the API keys of `auth.api_keys_file`.

use std::fmt;

use super::{api_key, jwks, jwt};
use crate::config::{AuthConfig, ConfigError};

/// What the files held.
#[derive(Clone, Default)]
pub struct KeyFiles {
    pub jwks: Vec<jwt::PublicKey>,
    /// Keys of `jwks_file` that were skipped, and why.
    pub jwks_skipped: Vec<String>,
    pub api_keys: Vec<api_key::Entry>,
}

impl fmt::Debug for KeyFiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyFiles")
            .field("jwks", &self.jwks.len())
            .field("api_keys", &self.api_keys.len())
            .finish()
    }
}

impl KeyFiles {
    /// Reads the files `cfg` names; `source` is the configuration's file,
    /// which the error names with the key.
    pub fn read(cfg: &AuthConfig, source: &str) -> Result<Self, ConfigError> {
        Self::read_files(cfg).map_err(|(key, problem)| ConfigError::Invalid {
            file: source.to_string(),
            key: key.to_string(),
            problem,
        })
    }

    fn read_files(cfg: &AuthConfig) -> Result<Self, (&'static str, String)> {
        let mut files = KeyFiles::default();
        if let Some(path) = &cfg.jwks_file {
            let at = "auth.jwks_file";
            let doc = std::fs::read(path)
                .map_err(|e| (at, format!("cannot read {}: {e}", path.display())))?;
            let (keys, skipped) =
                jwks::parse(&doc).map_err(|e| (at, format!("{}: {e}", path.display())))?;
            if keys.is_empty() {
                return Err((
                    at,
                    format!("{}: no usable key ({})", path.display(), skipped.join("; ")),
                ));
            }
            files.jwks = keys;
            files.jwks_skipped = skipped;
        }
        if let Some(path) = &cfg.api_keys_file {
            files.api_keys = api_key::load(path).map_err(|e| ("auth.api_keys_file", e))?;
        }
        Ok(files)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_file_is_named_by_its_key() {
        for (field, key) in [
            ("jwks_file", "auth.jwks_file"),
            ("api_keys_file", "auth.api_keys_file"),
        ] {
            let mut cfg = AuthConfig::default();
            match field {
                "jwks_file" => cfg.jwks_file = Some("/nonexistent/jwks.json".into()),
                _ => cfg.api_keys_file = Some("/nonexistent/keys.toml".into()),
            }
            let e = KeyFiles::read(&cfg, "bg.toml").unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("bg.toml: {key}: ")) && e.contains("/nonexistent/"),
                "{e}"
            );
        }
        let none = KeyFiles::read(&AuthConfig::default(), "bg.toml").unwrap();
        assert!(none.jwks.is_empty() && none.api_keys.is_empty());
    }
}
