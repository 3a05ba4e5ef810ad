//! `[server.cors]`: the web pages whose scripts may read the public API
//! from another origin (the answers are `http::cors`'s). Off while
//! `allow_origins` is empty, the default: then no response changes.
//!
//! Every origin is checked at start-up to be written as a browser sends
//! `Origin` (scheme, host, a port only when not the scheme's default; no
//! path, no trailing slash, lower case), because it is compared byte for
//! byte: a listed origin a browser never sends would fail silently, in
//! the browser, far from the config. `"*"` stands alone, and is refused
//! while any resource has `auth`.

use std::time::Duration;

use axum::http::HeaderName;
use serde::{Deserialize, Serialize};

use super::{AuthMode, KeyProblem, ResourceConfig};

/// The longest `max_age` taken: Firefox keeps a preflight at most a day
/// (Chromium two hours), so more would promise what no browser does.
pub const MAX_AGE_CAP: Duration = Duration::from_secs(24 * 3600);

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct CorsConfig {
    /// Origins whose pages may read the answers, as a browser writes
    /// `Origin`: `https://app.example.com`, `http://localhost:3000`.
    /// `["*"]`: any page (then `Access-Control-Allow-Origin: *`), refused
    /// while a resource has `auth`. Default empty: CORS off.
    #[serde(deserialize_with = "super::forms::list")]
    pub allow_origins: Vec<String>,
    /// Request headers a page's script may send, as a preflight's
    /// `Access-Control-Allow-Headers` says. Default `["Authorization",
    /// "If-None-Match", "If-Match", "X-Request-Id"]`: a bearer token and
    /// the revalidation of a row by its ETag. (`X-API-Key` is left out:
    /// a key in a page's script is a key published.)
    #[serde(deserialize_with = "super::forms::list")]
    pub allow_headers: Vec<String>,
    /// How long a browser may keep a preflight's answer
    /// (`Access-Control-Max-Age`, in whole seconds), at most `24h`.
    /// Default `10m`.
    #[serde(with = "crate::config::forms::duration")]
    pub max_age: Duration,
}

impl Default for CorsConfig {
    fn default() -> Self {
        Self {
            allow_origins: Vec::new(),
            allow_headers: ["Authorization", "If-None-Match", "If-Match", "X-Request-Id"]
                .map(String::from)
                .to_vec(),
            max_age: Duration::from_secs(600),
        }
    }
}

impl CorsConfig {
    /// Whether CORS is on.
    pub fn enabled(&self) -> bool {
        !self.allow_origins.is_empty()
    }

    /// Whether `"*"` is the list.
    pub fn any_origin(&self) -> bool {
        self.allow_origins.iter().any(|o| o == "*")
    }

    /// The section on its own (`key`: `server.cors`).
    pub(super) fn validate(&self, key: &str) -> Result<(), KeyProblem> {
        let origins = format!("{key}.allow_origins");
        if self.any_origin() && self.allow_origins.len() > 1 {
            return Err(KeyProblem::new(
                origins,
                "\"*\" stands alone: it allows every origin",
            ));
        }
        for o in self.allow_origins.iter().filter(|o| *o != "*") {
            canonical_origin(o).map_err(|p| KeyProblem::new(&origins, p))?;
        }
        for h in &self.allow_headers {
            if HeaderName::from_bytes(h.as_bytes()).is_err() {
                return Err(KeyProblem::new(
                    format!("{key}.allow_headers"),
                    format!("{h:?} is not a header name"),
                ));
            }
        }
        if self.max_age > MAX_AGE_CAP {
            return Err(KeyProblem::new(
                format!("{key}.max_age"),
                "at most 24h (browsers keep a preflight a day at most)",
            ));
        }
        Ok(())
    }

    /// `"*"` while a resource has `auth`: any page could then read with
    /// whatever credential its script holds; the pages meant to are
    /// listed instead.
    pub(super) fn validate_against(
        &self,
        key: &str,
        resources: &[ResourceConfig],
    ) -> Result<(), KeyProblem> {
        if !self.any_origin() {
            return Ok(());
        }
        match resources.iter().position(|r| r.auth != AuthMode::None) {
            None => Ok(()),
            Some(i) => Err(KeyProblem::new(
                format!("{key}.allow_origins"),
                format!(
                    "\"*\" is refused while a resource has auth (resource[{i}], {:?}): list the \
                     origins of the pages that may read it",
                    resources[i].name
                ),
            )),
        }
    }
}

/// `Ok` when `o` is an origin as a browser serialises it, else why not
/// and how to write it.
fn canonical_origin(o: &str) -> Result<(), String> {
    if o == "null" {
        return Err(
            "\"null\" is the origin of sandboxed frames and local files: any page can send it"
                .into(),
        );
    }
    let url = url::Url::parse(o).map_err(|_| {
        format!("{o:?} is not an origin (scheme://host[:port], e.g. https://app.example.com)")
    })?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("{o:?}: only http and https origins are taken"));
    }
    let written = url.origin().ascii_serialization();
    if written != o {
        return Err(format!(
            "{o:?} is not how a browser sends it: write {written:?} (no path or trailing slash, \
             lower case, no default port)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::config::tests::{MINIMAL, err};

    #[test]
    fn off_by_default_with_the_documented_defaults() {
        let c = Config::from_toml(MINIMAL).unwrap();
        assert!(!c.server.cors.enabled());
        assert_eq!(
            c.server.cors.allow_headers,
            ["Authorization", "If-None-Match", "If-Match", "X-Request-Id"]
        );
        assert_eq!(c.server.cors.max_age.as_secs(), 600);
    }

    #[test]
    fn origins_are_taken_only_as_a_browser_writes_them() {
        let ok = |o: &str| {
            Config::from_toml(&format!(
                "[server.cors]\nallow_origins = [{o:?}]\n{MINIMAL}"
            ))
        };
        for good in [
            "https://app.example.com",
            "http://localhost:3000",
            "https://xn--bcher-kva.example",
            "*",
        ] {
            assert!(ok(good).is_ok(), "{good}");
        }
        for (bad, says) in [
            (
                "https://app.example.com/",
                "write \"https://app.example.com\"",
            ),
            (
                "https://App.Example.com",
                "write \"https://app.example.com\"",
            ),
            (
                "https://app.example.com:443",
                "write \"https://app.example.com\"",
            ),
            ("https://app.example.com/path", "no path"),
            ("app.example.com", "not an origin"),
            ("ftp://files.example.com", "only http and https"),
            ("null", "sandboxed"),
        ] {
            let e = ok(bad).unwrap_err().to_string();
            assert!(
                e.contains("server.cors.allow_origins") && e.contains(says),
                "{bad}: {e}"
            );
        }
        let e = err(&format!(
            "[server.cors]\nallow_origins = [\"*\", \"https://a.example\"]\n{MINIMAL}"
        ));
        assert!(e.contains("stands alone"), "{e}");
        let e = err(&format!(
            "[server.cors]\nallow_origins = [\"https://a.example\"]\nallow_headers = [\"bad header\"]\n{MINIMAL}"
        ));
        assert!(e.contains("server.cors.allow_headers"), "{e}");
        let e = err(&format!(
            "[server.cors]\nallow_origins = [\"https://a.example\"]\nmax_age = \"25h\"\n{MINIMAL}"
        ));
        assert!(e.contains("server.cors.max_age"), "{e}");
    }

    /// Any page may not read with a caller's credential: `"*"` is a
    /// start-up error naming the key while a resource has `auth`, and
    /// taken while none has.
    #[test]
    fn any_origin_is_refused_while_a_resource_has_auth() {
        let cors = "[server.cors]\nallow_origins = [\"*\"]\n";
        assert!(Config::from_toml(&format!("{cors}{MINIMAL}")).is_ok());
        let private = format!(
            "{cors}[auth]\njwt_secret = \"{}\"\n{MINIMAL}auth = \"jwt\"\n",
            "s".repeat(32)
        );
        let e = err(&private);
        assert!(
            e.contains("server.cors.allow_origins") && e.contains("resource[0]"),
            "{e}"
        );
        // Listed origins are fine with auth.
        let listed = private.replace("[\"*\"]", "[\"https://app.example.com\"]");
        assert!(Config::from_toml(&listed).is_ok());
    }
}
