//! `[auth]` and the access rules a resource sets (`auth`, `scopes`,
//! `owner_claim`, `rate_limit`): where credentials are checked from and
//! what each resource asks of a caller. The files `[auth]` names are read by
//! `auth::key_files`, not here.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::KeyProblem;

/// Distinct scopes the resources may require together (one bit each).
pub const MAX_SCOPES: usize = 64;
/// Distinct owner claims the resources may name together.
pub const MAX_OWNER_CLAIMS: usize = 8;

/// `[[resource]] auth`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthMode {
    #[default]
    None,
    Jwt,
    ApiKey,
    Any,
}

impl AuthMode {
    pub fn is_none(&self) -> bool {
        *self == AuthMode::None
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AuthMode::None => "none",
            AuthMode::Jwt => "jwt",
            AuthMode::ApiKey => "api_key",
            AuthMode::Any => "any",
        }
    }

    /// Takes a bearer JWT.
    pub fn takes_jwt(self) -> bool {
        matches!(self, AuthMode::Jwt | AuthMode::Any)
    }

    /// Takes an `X-API-Key`.
    pub fn takes_api_key(self) -> bool {
        matches!(self, AuthMode::ApiKey | AuthMode::Any)
    }
}

/// `rate_limit` and its burst, parsed.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RateLimit {
    pub per_second: f64,
    pub burst: u32,
}

/// A resource's access rules, checked (see `auth`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Access {
    pub mode: AuthMode,
    pub scopes: Vec<String>,
    pub owner_claim: Option<String>,
    /// `None` with an `owner_claim`: the key, or the key part
    /// `owner_key_part`, is compared.
    pub owner_column: Option<String>,
    /// The composite key's part `owner_column` names, if it names one.
    pub owner_key_part: Option<usize>,
    pub rate_limit: Option<RateLimit>,
}

/// `"N/s"`, `"N/m"` (`/min`) or `"N/h"`, N a positive number: requests per
/// second.
pub fn parse_rate(text: &str) -> Result<f64, String> {
    let bad = || format!("{text:?} is not a rate such as \"20/s\", \"600/m\" or \"10000/h\"");
    let (n, unit) = text.split_once('/').ok_or_else(bad)?;
    let n: f64 = n.trim().parse().map_err(|_| bad())?;
    let seconds = match unit.trim() {
        "s" | "sec" | "second" => 1.0,
        "m" | "min" | "minute" => 60.0,
        "h" | "hour" => 3600.0,
        _ => return Err(bad()),
    };
    let per_second = n / seconds;
    if !(n.is_finite() && n > 0.0 && (1e-4..=1e9).contains(&per_second)) {
        return Err(format!(
            "{text:?}: the rate must be above 0 and between one request in about 3 hours and 1e9 a second"
        ));
    }
    Ok(per_second)
}

/// `[auth]`: where tokens and keys are checked from. Nothing here applies
/// to a resource whose `auth` is `none` (the default).
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The HS256/384/512 secret, at least 32 bytes; never logged, redacted
    /// in `check-config`. `BLOOMGATE_AUTH__JWT_SECRET` sets it from the
    /// environment. Default none.
    pub jwt_secret: Option<String>,
    /// `jwt_secret` is base64 (standard or URL-safe alphabet, padding
    /// optional), for a secret that is not text (PostgREST's
    /// `jwt-secret-is-base64`); the decoded bytes are the key and must
    /// be at least 32. Default false.
    pub jwt_secret_base64: bool,
    /// A JWK Set (RFC 7517) of RS*, PS*, ES256, ES384 or EdDSA (Ed25519)
    /// public keys, read at start-up. Default none.
    pub jwks_file: Option<PathBuf>,
    /// A JWK Set fetched at start-up, every `jwks_refresh_interval`, and
    /// when a token names a `kid` it lacks (at most once per
    /// `jwks_min_refetch_interval`, so no caller can make the gateway fetch
    /// at will). `https://`, or `http://` to a loopback address. Default
    /// none.
    pub jwks_url: Option<String>,
    /// Default `5m`.
    #[serde(with = "crate::config::forms::duration")]
    pub jwks_refresh_interval: Duration,
    /// Default `30s`.
    #[serde(with = "crate::config::forms::duration")]
    pub jwks_min_refetch_interval: Duration,
    /// How long the keys of the last good fetch of `jwks_url` stay
    /// trusted while fetches fail (unreachable, an HTTP error, not a key
    /// set): past it they are dropped, tokens signed by them are answered
    /// 503 and `/readyz` says why. A fetched key set always replaces the
    /// keys held, even an empty one. At least `jwks_refresh_interval`.
    /// Default `24h`.
    #[serde(with = "crate::config::forms::duration")]
    pub jwks_max_stale: Duration,
    /// When set, a token's `iss` must equal it. Default none.
    pub issuer: Option<String>,
    /// When set, a token's `aud` (a string or an array) must hold it; when
    /// not, a token that has an `aud` is refused (RFC 7519 §4.1.3: it is
    /// meant for someone else). Default none.
    pub audience: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`. At most `5m`. Default `30s`.
    #[serde(with = "crate::config::forms::duration")]
    pub leeway: Duration,
    /// The claim holding a token's scopes: a space-separated string
    /// (`scope`, RFC 8693; split on spaces only, RFC 6749 §3.3) or an
    /// array of strings (`scp`, `roles`). A name is a top-level claim;
    /// one starting with `/` is a JSON Pointer (RFC 6901) into the
    /// claims, e.g. `/realm_access/roles` (Keycloak). Default `scope`.
    pub scope_claim: String,
    /// A TOML file of named API keys (`[[key]]` with `name`, `key` or
    /// `sha256`, `scopes`), read at start-up. Default none.
    pub api_keys_file: Option<PathBuf>,
    /// Longest token or key looked at; longer ones are refused (401)
    /// before any decoding. Between 512 and 65536. Default 8192.
    pub max_token_bytes: usize,
    /// Verified tokens and keys remembered (until their `exp`), so a hit
    /// does not verify a signature: at most this many, about 200 bytes
    /// each plus the owner claims. Default 65536.
    pub token_cache_entries: usize,
    /// Callers whose rate-limit state is kept, across resources: a fixed
    /// table of this many 16-byte slots; an idle caller's slot is reused
    /// first. Default 65536.
    pub rate_limit_callers: usize,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            jwt_secret: None,
            jwt_secret_base64: false,
            jwks_file: None,
            jwks_url: None,
            jwks_refresh_interval: Duration::from_secs(300),
            jwks_min_refetch_interval: Duration::from_secs(30),
            jwks_max_stale: Duration::from_secs(86_400),
            issuer: None,
            audience: None,
            leeway: Duration::from_secs(30),
            scope_claim: "scope".into(),
            api_keys_file: None,
            max_token_bytes: 8192,
            token_cache_entries: 65536,
            rate_limit_callers: 65536,
        }
    }
}

impl fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthConfig")
            .field("jwt_secret", &self.jwt_secret.as_ref().map(|_| REDACTED))
            .field("jwt_secret_base64", &self.jwt_secret_base64)
            .field("jwks_file", &self.jwks_file)
            .field("jwks_url", &self.jwks_url)
            .field("jwks_refresh_interval", &self.jwks_refresh_interval)
            .field("jwks_min_refetch_interval", &self.jwks_min_refetch_interval)
            .field("jwks_max_stale", &self.jwks_max_stale)
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("leeway", &self.leeway)
            .field("scope_claim", &self.scope_claim)
            .field("api_keys_file", &self.api_keys_file)
            .field("max_token_bytes", &self.max_token_bytes)
            .field("token_cache_entries", &self.token_cache_entries)
            .field("rate_limit_callers", &self.rate_limit_callers)
            .finish()
    }
}

/// What a secret is shown as.
pub const REDACTED: &str = "<redacted>";

/// `auth.jwt_secret` in `check-config`: long enough to be accepted, so the
/// printed config still loads (`fuzz/config_parse` checks it does), and
/// plainly not the secret.
pub const REDACTED_SECRET: &str = "<redacted: the secret is never shown>";

/// The shortest `auth.jwt_secret`: 256 bits, the size of HS256's output
/// (RFC 7518 §3.2).
pub const MIN_JWT_SECRET: usize = 32;

impl AuthConfig {
    /// Has a source of tokens to verify JWTs with.
    pub fn has_jwt(&self) -> bool {
        self.jwt_secret.is_some() || self.jwks_file.is_some() || self.jwks_url.is_some()
    }

    /// Has API keys to check.
    pub fn has_api_keys(&self) -> bool {
        self.api_keys_file.is_some()
    }

    /// The HMAC key `jwt_secret` gives: its bytes, or with
    /// `jwt_secret_base64` what they decode to (`None` if they do not).
    pub fn jwt_secret_bytes(&self) -> Option<Vec<u8>> {
        let s = self.jwt_secret.as_ref()?;
        if !self.jwt_secret_base64 {
            return Some(s.as_bytes().to_vec());
        }
        decode_base64(s.trim())
    }

    pub(super) fn validate(&self) -> Result<(), KeyProblem> {
        let bad = |key: &str, problem: String| Err(KeyProblem::new(format!("auth.{key}"), problem));
        if self.jwt_secret_base64 && self.jwt_secret.is_none() {
            return bad("jwt_secret_base64", "needs auth.jwt_secret".into());
        }
        if self.jwt_secret.is_some() {
            // Never quoted: the message says what is wrong, not what it is.
            let Some(key) = self.jwt_secret_bytes() else {
                return bad(
                    "jwt_secret",
                    "is not base64 (auth.jwt_secret_base64 = true): the standard or URL-safe \
                     alphabet, padding optional"
                        .into(),
                );
            };
            if key.len() < MIN_JWT_SECRET {
                let what = match self.jwt_secret_base64 {
                    true => "decoded bytes",
                    false => "bytes",
                };
                return bad(
                    "jwt_secret",
                    format!(
                        "must be at least {MIN_JWT_SECRET} bytes (HS256 needs 256 bits); it has {} {what}",
                        key.len()
                    ),
                );
            }
        }
        if let Some(u) = &self.jwks_url {
            check_jwks_url(u).map_err(|p| KeyProblem::new("auth.jwks_url", p))?;
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(86_400))
            .contains(&self.jwks_refresh_interval)
        {
            return bad("jwks_refresh_interval", "must be between 1s and 1d".into());
        }
        if self.jwks_min_refetch_interval < Duration::from_secs(1)
            || self.jwks_min_refetch_interval > self.jwks_refresh_interval
        {
            return bad(
                "jwks_min_refetch_interval",
                "must be at least 1s and at most jwks_refresh_interval".into(),
            );
        }
        if self.jwks_max_stale < self.jwks_refresh_interval {
            return bad(
                "jwks_max_stale",
                "must be at least jwks_refresh_interval (the keys would expire between two good fetches)".into(),
            );
        }
        if self.leeway > Duration::from_secs(300) {
            return bad("leeway", "must be at most 5m".into());
        }
        check_claim(&self.scope_claim).map_err(|p| KeyProblem::new("auth.scope_claim", p))?;
        if !(512..=65_536).contains(&self.max_token_bytes) {
            return bad("max_token_bytes", "must be between 512 and 65536".into());
        }
        if !(16..=1 << 24).contains(&self.token_cache_entries) {
            return bad(
                "token_cache_entries",
                "must be between 16 and 16777216".into(),
            );
        }
        if !(16..=1 << 24).contains(&self.rate_limit_callers) {
            return bad(
                "rate_limit_callers",
                "must be between 16 and 16777216".into(),
            );
        }
        Ok(())
    }
}

/// Base64 in the standard or the URL-safe alphabet, padded or not.
fn decode_base64(s: &str) -> Option<Vec<u8>> {
    use base64::Engine;
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    let config =
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
    let standard = GeneralPurpose::new(&base64::alphabet::STANDARD, config);
    let url_safe = GeneralPurpose::new(&base64::alphabet::URL_SAFE, config);
    standard.decode(s).or_else(|_| url_safe.decode(s)).ok()
}

/// A claim as `scope_claim` and `owner_claim` name it: a top-level name,
/// or a JSON Pointer (RFC 6901: `/` then reference tokens, `~0` for `~`
/// and `~1` for `/`, no other `~`).
pub fn check_claim(c: &str) -> Result<(), String> {
    if c.is_empty() || c.len() > 256 {
        return Err("must name a claim (1 to 256 bytes)".into());
    }
    if let Some(pointer) = c.strip_prefix('/') {
        let mut chars = pointer.chars();
        while let Some(ch) = chars.next() {
            if ch == '~' && !matches!(chars.next(), Some('0' | '1')) {
                return Err(format!(
                    "{c:?} is not a JSON Pointer (RFC 6901): '~' must be followed by 0 or 1"
                ));
            }
        }
    }
    Ok(())
}

/// A scope token (RFC 6749 §3.3): printable ASCII, no space, `"` or `\`,
/// so it can be quoted in `WWW-Authenticate`.
pub(super) fn is_scope(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b == 0x21 || (0x23..=0x5b).contains(&b) || (0x5d..=0x7e).contains(&b))
}

/// `auth.jwks_url`: `https`, or `http` to a loopback address (a sidecar,
/// a test); no user or password in it.
pub fn check_jwks_url(text: &str) -> Result<(), String> {
    let url = url::Url::parse(text).map_err(|e| format!("{text:?} is not a URL: {e}"))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must not carry a user or password".into());
    }
    let loopback = match url.host() {
        Some(url::Host::Ipv4(a)) => a.is_loopback(),
        Some(url::Host::Ipv6(a)) => a.is_loopback(),
        Some(url::Host::Domain(d)) => d == "localhost",
        None => return Err("has no host".into()),
    };
    match url.scheme() {
        "https" => Ok(()),
        "http" if loopback => Ok(()),
        "http" => Err(
            "must be https:// (plain http:// only to a loopback address): a key set read in \
             the clear can be replaced on the way"
                .into(),
        ),
        s => Err(format!("scheme {s:?}: use https://")),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use super::*;
    use crate::config::Config;
    use crate::config::tests::{MINIMAL, err};

    const PRIVATE: &str = r#"
        [[resource]]
        name = "me"
        route = "/me/{id}"
        table = "users"
        key_column = "id"
        key_type = "bigint"
        columns = ["id", "owner_id", "email"]
        auth = "jwt"
        scopes = ["users:read"]
        owner_claim = "sub"
        owner_column = "owner_id"
        rate_limit = "600/m"
    "#;
    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn access_rules_have_defaults_and_resolve() {
        let c = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(c.resolved()[0].access, Access::default());
        assert_eq!(c.auth.leeway, Duration::from_secs(30));
        assert_eq!(c.auth.scope_claim, "scope");
        assert_eq!(c.auth.max_token_bytes, 8192);
        let c = Config::from_toml(&format!(
            "[auth]\njwt_secret = \"{SECRET}\"\n{MINIMAL}{PRIVATE}"
        ))
        .unwrap();
        let a = &c.resolved()[1].access;
        assert_eq!(a.mode, AuthMode::Jwt);
        assert_eq!(a.owner_column.as_deref(), Some("owner_id"));
        let rate = a.rate_limit.unwrap();
        assert_eq!((rate.per_second, rate.burst), (10.0, 10));
        // An owner column that is the key is the key.
        let c = Config::from_toml(&format!(
            "[auth]\njwt_secret = \"{SECRET}\"\n{}",
            PRIVATE.replace("\"owner_id\"\n", "\"id\"\n")
        ))
        .unwrap();
        assert_eq!(c.resolved()[0].access.owner_column, None);
    }

    #[test]
    fn access_errors_name_the_key() {
        let with = |auth: &str, res: &str| err(&format!("[auth]\n{auth}\n{res}"));
        let s = format!("jwt_secret = \"{SECRET}\"");
        for (auth, res, key) in [
            (
                "jwt_secret = \"short\"",
                PRIVATE.to_string(),
                "auth.jwt_secret",
            ),
            ("", PRIVATE.to_string(), "resource[0].auth"),
            (
                &s,
                PRIVATE.replace("\"jwt\"", "\"api_key\""),
                "resource[0].auth",
            ),
            (
                &s,
                PRIVATE.replace("auth = \"jwt\"", "auth = \"none\""),
                "resource[0].scopes",
            ),
            (
                &s,
                PRIVATE.replace("\"users:read\"", "\"a b\""),
                "resource[0].scopes",
            ),
            (
                &s,
                PRIVATE.replace("\"owner_id\"\n", "\"other\"\n"),
                "resource[0].owner_column",
            ),
            (
                &s,
                PRIVATE.replace("600/m", "fast"),
                "resource[0].rate_limit",
            ),
            (
                &s,
                PRIVATE.replace("600/m", "0/s"),
                "resource[0].rate_limit",
            ),
            (
                &s,
                format!("{PRIVATE}rate_limit_burst = 0\n"),
                "resource[0].rate_limit_burst",
            ),
            (
                &format!("{s}\njwks_url = \"http://idp.example.com/jwks\""),
                PRIVATE.into(),
                "auth.jwks_url",
            ),
            (
                &format!("{s}\nleeway = \"1h\""),
                PRIVATE.into(),
                "auth.leeway",
            ),
            (
                &format!("{s}\nmax_token_bytes = 10"),
                PRIVATE.into(),
                "auth.max_token_bytes",
            ),
            (
                &format!("{s}\njwks_refresh_interval = \"1h\"\njwks_max_stale = \"10m\""),
                PRIVATE.into(),
                "auth.jwks_max_stale",
            ),
            (
                &format!("{s}\nscope_claim = \"/realm_access/~2\""),
                PRIVATE.into(),
                "auth.scope_claim",
            ),
            (
                &s,
                PRIVATE.replace("owner_claim = \"sub\"", "owner_claim = \"/a~\""),
                "resource[0].owner_claim",
            ),
            (
                "jwt_secret_base64 = true",
                PRIVATE.into(),
                "auth.jwt_secret_base64",
            ),
            (
                &format!("{s}\njwt_secret_base64 = true"),
                PRIVATE.into(),
                "auth.jwt_secret",
            ),
        ] {
            let e = with(auth, &res);
            assert!(e.contains(key), "{key}: {e}");
            assert!(!e.contains(SECRET), "{e}");
        }
    }

    /// `jwt_secret_base64`: the secret's decoded bytes are the key, in
    /// either alphabet, padded or not; too few of them, or not base64, is
    /// an error naming the key and never quoting the secret; the printed
    /// config loads again.
    #[test]
    fn a_base64_secret_is_decoded_checked_and_never_shown() {
        use base64::Engine;
        use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
        let key: Vec<u8> = (0u8..48).map(|i| i.wrapping_mul(37) ^ 0xfb).collect();
        for encoded in [STANDARD.encode(&key), URL_SAFE_NO_PAD.encode(&key)] {
            let c = Config::from_toml(&format!(
                "[auth]\njwt_secret = \"{encoded}\"\njwt_secret_base64 = true\n{PRIVATE}"
            ))
            .unwrap();
            assert_eq!(c.auth.jwt_secret_bytes(), Some(key.clone()));
            let shown = c.to_redacted_toml();
            assert!(!shown.contains(&encoded), "{shown}");
            Config::from_toml(&shown).expect("the printed config loads");
        }
        let short = STANDARD.encode([7u8; 31]);
        let e = err(&format!(
            "[auth]\njwt_secret = \"{short}\"\njwt_secret_base64 = true\n{PRIVATE}"
        ));
        assert!(
            e.contains("auth.jwt_secret") && e.contains("31 decoded bytes"),
            "{e}"
        );
        assert!(!e.contains(&short), "{e}");
        // Without the flag the text is the key, as before.
        let c =
            Config::from_toml(&format!("[auth]\njwt_secret = \"{SECRET}\"\n{PRIVATE}")).unwrap();
        assert_eq!(c.auth.jwt_secret_bytes().unwrap(), SECRET.as_bytes());
    }

    /// The secret comes from the environment, is redacted in
    /// `check-config` and in `Debug`, and never shown.
    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns its own error
    fn the_jwt_secret_comes_from_the_environment_and_is_never_shown() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("bg.toml", &format!("{MINIMAL}{PRIVATE}"))?;
            jail.set_env("BLOOMGATE_AUTH__JWT_SECRET", SECRET);
            let c = Config::load(Path::new("bg.toml")).map_err(|e| e.to_string())?;
            assert_eq!(c.auth.jwt_secret.as_deref(), Some(SECRET));
            let shown = format!("{}\n{c:?}", c.to_redacted_toml());
            assert!(!shown.contains(SECRET), "{shown}");
            assert!(shown.contains(REDACTED));
            jail.set_env("BLOOMGATE_AUTH_JWT_SECRET", SECRET);
            let e = Config::load(Path::new("bg.toml")).unwrap_err().to_string();
            assert!(
                e.contains("BLOOMGATE_AUTH__JWT_SECRET") && !e.contains(SECRET),
                "{e}"
            );
            Ok(())
        });
    }
}
