//! JSON Web Tokens: JWS compact serialisation (RFC 7515) carrying JWT
//! claims (RFC 7519), signatures checked with `ring`.
//!
//! # Why here and not `jsonwebtoken`
//! `ring` is in the build already (rustls uses it). jsonwebtoken 11 checks
//! signatures through either aws-lc-rs (a C and CMake build) or RustCrypto
//! (a dozen more crates, and slower ECDSA and RSA verification than
//! `ring`'s), or a process-wide provider of our own whose fallback panics
//! when none was installed; its 9.x line, the last on `ring`, has the
//! `exp`/`nbf` type confusion of CVE-2026-25537. What is left once the
//! cryptography is `ring`'s is parsing, which is small and fuzzed
//! (`fuzz/fuzz_targets/token_verify.rs`).
//!
//! # What is refused, before any signature is checked
//! - more than `max_token_bytes`, not three base64url parts, padding or
//!   any byte outside the base64url alphabet;
//! - a header over [`MAX_HEADER`] bytes, not a JSON object, with a
//!   duplicate member, or with `crit` (no extension is understood) or
//!   `b64: false`;
//! - an `alg` other than those [`Alg`] names (`none` included);
//! - an `alg` the chosen key is not for: a key carries its one algorithm,
//!   and HMAC keys come only from `auth.jwt_secret`, never from a key set,
//!   so a token signed "HS256" with an RSA key's public bytes finds no key
//!   (algorithm confusion);
//! - a `kid` no key has.
//!
//! Header members that would fetch or embed a key (`jku`, `x5u`, `jwk`,
//! `x5c`) are ignored: keys come from the config only.

use std::borrow::Cow;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;
use serde::Deserialize;
use serde_json::{Map, Value};

mod keys;

pub use keys::{Alg, PublicKey, Secret};

/// Longest header accepted, in base64url characters.
pub const MAX_HEADER: usize = 1024;

/// Why a token was refused. The message is safe to send: it never quotes
/// the token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invalid {
    TooLong,
    Malformed,
    Algorithm,
    UnknownKey,
    Signature,
    Expired,
    NotYetValid,
    Issuer,
    /// An `aud` without `auth.audience` among its values.
    Audience,
    /// No `aud`, and `auth.audience` is set.
    NoAudience,
    /// An `aud`, and `auth.audience` is not set (RFC 7519 §4.1.3).
    UnexpectedAudience,
    Claims,
}

impl Invalid {
    pub const ALL: [Invalid; 12] = [
        Invalid::TooLong,
        Invalid::Malformed,
        Invalid::Algorithm,
        Invalid::UnknownKey,
        Invalid::Signature,
        Invalid::Expired,
        Invalid::NotYetValid,
        Invalid::Issuer,
        Invalid::Audience,
        Invalid::NoAudience,
        Invalid::UnexpectedAudience,
        Invalid::Claims,
    ];

    /// The `reason` label of `bloomgate_auth_failures_total`.
    pub fn reason(self) -> &'static str {
        match self {
            Invalid::TooLong => "too_long",
            Invalid::Malformed => "malformed",
            Invalid::Algorithm => "algorithm",
            Invalid::UnknownKey => "unknown_key",
            Invalid::Signature => "signature",
            Invalid::Expired => "expired",
            Invalid::NotYetValid => "not_yet_valid",
            Invalid::Issuer => "issuer",
            Invalid::Audience => "audience",
            Invalid::NoAudience => "no_audience",
            Invalid::UnexpectedAudience => "unexpected_audience",
            Invalid::Claims => "claims",
        }
    }

    /// The cause in a fixed sentence (what [`explain`] says when it can
    /// say more).
    pub fn message(self) -> &'static str {
        match self {
            Invalid::TooLong => "the token is longer than this gateway accepts",
            Invalid::Malformed => "the token is not a well-formed JWS compact token",
            Invalid::Algorithm => "the token's algorithm is not accepted for its key",
            Invalid::UnknownKey => "the token's signing key is not known",
            Invalid::Signature => "the token's signature does not verify",
            Invalid::Expired => "the token has expired",
            Invalid::NotYetValid => "the token is not valid yet",
            Invalid::Issuer => "the token's issuer is not accepted",
            Invalid::Audience => "the token is meant for another audience",
            Invalid::NoAudience => "the token names no audience, and this gateway requires one",
            Invalid::UnexpectedAudience => {
                "the token names an audience, and this gateway is configured for none"
            }
            Invalid::Claims => "the token's claims are missing or malformed (exp is required)",
        }
    }
}

/// What is checked besides the signature.
#[derive(Clone, Debug, Default)]
pub struct Rules {
    pub issuer: Option<String>,
    pub audience: Option<String>,
    /// Seconds of clock skew allowed on `exp` and `nbf`.
    pub leeway: u64,
    pub scope_claim: String,
    /// The owner claims any resource names, in a fixed order.
    pub owner_claims: Vec<String>,
}

/// A verified token's claims, as far as the gateway uses them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claims {
    /// Seconds since the epoch from which it is valid (`nbf` less the
    /// leeway; 0 without `nbf`).
    pub valid_from: u64,
    /// Seconds since the epoch from which it is not (`exp` plus the leeway).
    pub valid_until: u64,
    pub sub: Option<String>,
    pub scopes: Vec<String>,
    /// The values of [`Rules::owner_claims`], in that order.
    pub owners: Vec<OwnerClaim>,
}

/// An owner claim as a token holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnerClaim {
    /// A string, or an integer in decimal: the owner it names.
    Owner(Box<str>),
    /// An array of those: a caller who owns rows in several tenants. Any
    /// of them matches; an empty array matches nothing.
    Owners(Box<[Box<str>]>),
    /// The token has no such claim.
    Absent,
    /// A value that names no owner (an object, a fraction, a boolean,
    /// null, an array holding any of those): what it holds, for the
    /// refusal to say.
    Unusable(Box<str>),
}

/// Owners one array claim may name at most (each is compared per request).
pub const MAX_OWNERS: usize = 256;

impl OwnerClaim {
    fn of(v: Option<&Value>) -> Self {
        match v {
            None => OwnerClaim::Absent,
            Some(array @ Value::Array(items)) if items.len() <= MAX_OWNERS => {
                match items.iter().map(identity).collect::<Option<Vec<String>>>() {
                    Some(owners) => {
                        OwnerClaim::Owners(owners.into_iter().map(String::into_boxed_str).collect())
                    }
                    None => OwnerClaim::Unusable(holds(array).into_boxed_str()),
                }
            }
            Some(v) => match identity(v) {
                Some(owner) => OwnerClaim::Owner(owner.into_boxed_str()),
                None => OwnerClaim::Unusable(holds(v).into_boxed_str()),
            },
        }
    }

    /// The owners it names (none for an empty array); `None` for a claim
    /// that names no owner.
    pub fn owners(&self) -> Option<&[Box<str>]> {
        match self {
            OwnerClaim::Owner(o) => Some(std::slice::from_ref(o)),
            OwnerClaim::Owners(o) => Some(o),
            _ => None,
        }
    }
}

/// A token split and its header read, before a key is chosen.
#[derive(Debug)]
pub struct Parsed<'a> {
    signing_input: &'a [u8],
    payload: &'a [u8],
    signature: &'a [u8],
    pub alg: Alg,
    pub kid: Option<String>,
}

#[derive(Deserialize)]
struct Header<'a> {
    #[serde(borrow)]
    alg: Cow<'a, str>,
    #[serde(default, borrow)]
    kid: Option<Cow<'a, str>>,
    #[serde(default)]
    crit: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    b64: Option<bool>,
}

fn b64(part: &[u8]) -> Result<Vec<u8>, Invalid> {
    URL_SAFE_NO_PAD.decode(part).map_err(|_| Invalid::Malformed)
}

/// Splits `token` and reads its header.
pub fn parse(token: &[u8], max_len: usize) -> Result<Parsed<'_>, Invalid> {
    if token.len() > max_len {
        return Err(Invalid::TooLong);
    }
    let mut dots = token
        .iter()
        .enumerate()
        .filter(|&(_, &b)| b == b'.')
        .map(|(i, _)| i);
    let (Some(first), Some(second), None) = (dots.next(), dots.next(), dots.next()) else {
        return Err(Invalid::Malformed);
    };
    let header = &token[..first];
    if header.is_empty() || header.len() > MAX_HEADER {
        return Err(Invalid::Malformed);
    }
    let decoded = b64(header)?;
    let h: Header = serde_json::from_slice(&decoded).map_err(|_| Invalid::Malformed)?;
    if h.crit.is_some() || h.b64 == Some(false) {
        return Err(Invalid::Malformed);
    }
    let alg = Alg::from_name(&h.alg).ok_or(Invalid::Algorithm)?;
    let kid = match h.kid {
        Some(k) if k.len() > 256 => return Err(Invalid::Malformed),
        k => k.map(Cow::into_owned),
    };
    Ok(Parsed {
        signing_input: &token[..second],
        payload: &token[first + 1..second],
        signature: &token[second + 1..],
        alg,
        kid,
    })
}

/// The key a parsed token names among `keys`: by `kid`, or, without one,
/// the only key for its algorithm. `Err(Algorithm)` when the key found is
/// for another algorithm.
pub fn choose<'k>(parsed: &Parsed<'_>, keys: &'k [PublicKey]) -> Result<&'k PublicKey, Invalid> {
    let key = match &parsed.kid {
        Some(kid) => keys
            .iter()
            .find(|k| k.kid.as_deref() == Some(kid.as_str()))
            .ok_or(Invalid::UnknownKey)?,
        None => {
            let mut of_alg = keys.iter().filter(|k| k.alg == parsed.alg);
            match (of_alg.next(), of_alg.next()) {
                (Some(k), None) => k,
                _ => return Err(Invalid::UnknownKey),
            }
        }
    };
    if key.alg != parsed.alg {
        return Err(Invalid::Algorithm);
    }
    Ok(key)
}

/// Checks the signature with `key` (a public key) or `secret` (HS*).
pub fn verify_signature(
    parsed: &Parsed<'_>,
    key: Option<&PublicKey>,
    secret: Option<&Secret>,
) -> Result<(), Invalid> {
    let sig = b64(parsed.signature)?;
    let ok = if parsed.alg.is_hmac() {
        let key = secret
            .and_then(|s| s.key(parsed.alg))
            .ok_or(Invalid::Algorithm)?;
        hmac::verify(key, parsed.signing_input, &sig).is_ok()
    } else {
        let key = key.ok_or(Invalid::UnknownKey)?;
        if key.alg != parsed.alg {
            return Err(Invalid::Algorithm);
        }
        key.verify(parsed.signing_input, &sig)
    };
    if ok { Ok(()) } else { Err(Invalid::Signature) }
}

/// A NumericDate (RFC 7519 §2): a JSON number of seconds, fractions
/// dropped. A string, a negative or a non-finite value is refused.
fn numeric_date(v: &Value) -> Result<u64, Invalid> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .or_else(|| {
                n.as_f64()
                    .filter(|f| f.is_finite() && *f >= 0.0 && *f < 1.8e19)
                    .map(|f| f as u64)
            })
            .ok_or(Invalid::Claims),
        _ => Err(Invalid::Claims),
    }
}

/// A claim value usable as an identity: a string, or an integer written
/// in decimal.
fn identity(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        _ => None,
    }
}

/// The claim `name` names: a top-level member, or, for a name starting
/// with `/`, the value a JSON Pointer (RFC 6901) leads to
/// (`/realm_access/roles`, `/https:~1~1example.com~1tenant`).
fn claim<'m>(map: &'m Map<String, Value>, name: &str) -> Option<&'m Value> {
    let Some(pointer) = name.strip_prefix('/') else {
        return map.get(name);
    };
    let (first, rest) = match pointer.find('/') {
        Some(i) => (&pointer[..i], &pointer[i..]),
        None => (pointer, ""),
    };
    let first = first.replace("~1", "/").replace("~0", "~");
    map.get(&first)?.pointer(rest)
}

/// Reads and checks the claims of a token whose signature verified, at
/// `now` (seconds since the epoch). A claim given twice in the payload
/// counts as its last value (`serde_json`'s map keeps the last), as most
/// JWT libraries read it; RFC 7519 §4 lets a parser refuse or take the
/// last.
pub fn claims(parsed: &Parsed<'_>, rules: &Rules, now: u64) -> Result<Claims, Invalid> {
    let payload = b64(parsed.payload)?;
    let map: Map<String, Value> = serde_json::from_slice(&payload).map_err(|_| Invalid::Claims)?;
    let exp = numeric_date(map.get("exp").ok_or(Invalid::Claims)?)?;
    let valid_until = exp.saturating_add(rules.leeway);
    if now >= valid_until {
        return Err(Invalid::Expired);
    }
    let valid_from = match map.get("nbf") {
        Some(v) => numeric_date(v)?.saturating_sub(rules.leeway),
        None => 0,
    };
    if now < valid_from {
        return Err(Invalid::NotYetValid);
    }
    if let Some(want) = &rules.issuer
        && map.get("iss").and_then(Value::as_str) != Some(want.as_str())
    {
        return Err(Invalid::Issuer);
    }
    match (map.get("aud"), &rules.audience) {
        (None, None) => {}
        (Some(_), None) => return Err(Invalid::UnexpectedAudience),
        (None, Some(_)) => return Err(Invalid::NoAudience),
        (Some(aud), Some(want)) => {
            let ok = match aud {
                Value::String(s) => s == want,
                Value::Array(a) => a.iter().any(|v| v.as_str() == Some(want.as_str())),
                _ => false,
            };
            if !ok {
                return Err(Invalid::Audience);
            }
        }
    }
    let sub = match map.get("sub") {
        None => None,
        Some(v) => Some(identity(v).ok_or(Invalid::Claims)?),
    };
    let scopes = match claim(&map, &rules.scope_claim) {
        None => Vec::new(),
        // RFC 6749 §3.3: scope tokens are separated by spaces, and only
        // by spaces (a tab is part of a token, which no scope then
        // matches).
        Some(Value::String(s)) => s
            .split(' ')
            .filter(|t| !t.is_empty())
            .map(String::from)
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(String::from).ok_or(Invalid::Claims))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(Invalid::Claims),
    };
    let owners = rules
        .owner_claims
        .iter()
        .map(|c| OwnerClaim::of(claim(&map, c)))
        .collect();
    Ok(Claims {
        valid_from,
        valid_until,
        sub,
        scopes,
        owners,
    })
}

/// Longest quotation of a claim's value in a refusal.
const SHOWN: usize = 96;

/// `v` as JSON, cut at [`SHOWN`] bytes (a refusal quotes what a claim
/// holds, never the token, and never at any length).
pub fn shown(v: &Value) -> String {
    let mut text = v.to_string();
    if text.len() > SHOWN {
        let mut cut = SHOWN;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
}

/// What a claim holds that is not what it should be: its kind and value.
fn holds(v: &Value) -> String {
    let kind = match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number that is no 64-bit integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    format!("{kind}, {}", shown(v))
}

/// Why a token whose signature verified was refused as `why`, with what
/// its claims hold and, where there is one, the fix: the message of its
/// 401. `None` where the fixed sentence ([`Invalid::message`]) is all
/// there is to say. The token itself is never quoted; a claim's value is,
/// cut short ([`shown`]).
pub fn explain(parsed: &Parsed<'_>, rules: &Rules, now: u64, why: Invalid) -> Option<String> {
    let payload = b64(parsed.payload).ok()?;
    let Ok(map) = serde_json::from_slice::<Map<String, Value>>(&payload) else {
        return Some("the token's claims are not a JSON object".into());
    };
    let leeway = rules.leeway;
    let ago = |secs: u64| humantime::format_duration(std::time::Duration::from_secs(secs));
    let want_aud = rules.audience.as_deref().unwrap_or_default();
    let issue_for = |aud: &str| {
        format!(
            "have the identity provider issue tokens for {aud:?} (Keycloak: an Audience mapper \
             on the client or a client scope, since its default aud is \"account\"; Auth0: \
             {aud:?} as the audience parameter, the API's identifier)"
        )
    };
    Some(match why {
        Invalid::Expired => {
            let exp = map.get("exp").and_then(|v| numeric_date(v).ok())?;
            format!(
                "the token expired {} ago (exp {exp}; auth.leeway allows {leeway} s of clock skew)",
                ago(now.saturating_sub(exp))
            )
        }
        Invalid::NotYetValid => {
            let nbf = map.get("nbf").and_then(|v| numeric_date(v).ok())?;
            format!(
                "the token is valid only in {} (nbf {nbf}; auth.leeway allows {leeway} s of clock \
                 skew): is the issuer's clock or this host's off?",
                ago(nbf.saturating_sub(leeway).saturating_sub(now))
            )
        }
        Invalid::Issuer => {
            let want = rules.issuer.as_deref().unwrap_or_default();
            match map.get("iss") {
                None => format!("the token has no iss, and auth.issuer requires {want:?}"),
                Some(got @ Value::String(text))
                    if text.trim_end_matches('/') == want.trim_end_matches('/') =>
                {
                    format!(
                        "the token's iss is {}, and auth.issuer is {want:?}: they differ by the \
                         trailing slash, which counts (Auth0's issuer ends in one, Keycloak's \
                         does not)",
                        shown(got)
                    )
                }
                Some(got) => format!(
                    "the token's iss is {}, and auth.issuer is {want:?}",
                    shown(got)
                ),
            }
        }
        Invalid::Audience => format!(
            "the token's aud is {}, which does not hold auth.audience {want_aud:?}: {}, or set \
             auth.audience to the audience the tokens carry",
            shown(map.get("aud")?),
            issue_for(want_aud)
        ),
        Invalid::NoAudience => format!(
            "the token has no aud, and auth.audience requires {want_aud:?}: {}",
            issue_for(want_aud)
        ),
        Invalid::UnexpectedAudience => format!(
            "the token's aud is {}, and auth.audience is not set: a token meant for an audience \
             is taken only where auth.audience names it (RFC 7519 section 4.1.3); set \
             auth.audience to this gateway's",
            shown(map.get("aud")?)
        ),
        Invalid::Claims => {
            let bad_date = |name: &str| {
                map.get(name).filter(|v| numeric_date(v).is_err()).map(|v| {
                    format!(
                        "the token's {name} is {}: a number of seconds since 1970 is required",
                        holds(v)
                    )
                })
            };
            if !map.contains_key("exp") {
                "the token has no exp: an expiry is required".into()
            } else if let Some(d) = bad_date("exp").or_else(|| bad_date("nbf")) {
                d
            } else if let Some(sub) = map.get("sub").filter(|v| identity(v).is_none()) {
                format!(
                    "the token's sub is {}: a string or an integer is required",
                    holds(sub)
                )
            } else if let Some(scopes) = claim(&map, &rules.scope_claim) {
                format!(
                    "the claim {:?} (auth.scope_claim) is {}: scopes are a space-separated \
                     string or an array of strings",
                    rules.scope_claim,
                    holds(scopes)
                )
            } else {
                return None;
            }
        }
        _ => return None,
    })
}

/// A compact token of `header` and `claims` signed by `sign` (given the
/// signing input): what tests, benchmarks and `bloomgate mint-token` use.
pub fn encode(header: &Value, claims: &Value, sign: impl FnOnce(&[u8]) -> Vec<u8>) -> String {
    let mut token = URL_SAFE_NO_PAD.encode(header.to_string());
    token.push('.');
    token.push_str(&URL_SAFE_NO_PAD.encode(claims.to_string()));
    let sig = sign(token.as_bytes());
    token.push('.');
    token.push_str(&URL_SAFE_NO_PAD.encode(sig));
    token
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn rules() -> Rules {
        Rules {
            leeway: 30,
            scope_claim: "scope".into(),
            owner_claims: vec!["sub".into(), "tenant".into()],
            ..Rules::default()
        }
    }

    fn hs256(claims: Value) -> String {
        let s = Secret::new(SECRET);
        encode(&json!({"alg": "HS256", "typ": "JWT"}), &claims, |m| {
            s.sign(Alg::HS256, m).unwrap()
        })
    }

    fn check(token: &str, rules: &Rules, now: u64) -> Result<Claims, Invalid> {
        let p = parse(token.as_bytes(), 8192)?;
        verify_signature(&p, None, Some(&Secret::new(SECRET)))?;
        claims(&p, rules, now)
    }

    /// Claims where identity providers put them: a JSON Pointer reaches
    /// nested (Keycloak) and namespaced (Auth0) claims; a plain name is a
    /// top-level claim, slashes and all.
    #[test]
    fn json_pointer_claims_reach_nested_and_namespaced_values() {
        let t = hs256(json!({
            "exp": 2000,
            "realm_access": {"roles": ["users:read", "admin"]},
            "https://example.com/tenant": "t-9",
            "org": {"ids": [17, 18]},
        }));
        let mut r = rules();
        r.scope_claim = "/realm_access/roles".into();
        r.owner_claims = vec![
            "/https:~1~1example.com~1tenant".into(),
            "https://example.com/tenant".into(),
            "/org/ids/1".into(),
            "/org/missing".into(),
            "/realm_access".into(),
        ];
        let c = check(&t, &r, 1000).unwrap();
        assert_eq!(c.scopes, ["users:read", "admin"]);
        let owner = |s: &str| OwnerClaim::Owner(s.into());
        assert_eq!(
            c.owners,
            [
                owner("t-9"),
                owner("t-9"),
                owner("18"),
                OwnerClaim::Absent,
                OwnerClaim::Unusable(r#"an object, {"roles":["users:read","admin"]}"#.into()),
            ]
        );
    }

    /// RFC 6749 §3.3: scopes are separated by spaces only; a tab or a
    /// newline is part of a token.
    #[test]
    fn scopes_split_on_spaces_only() {
        let t = hs256(json!({"exp": 2000, "scope": "a  b\tc\nd "}));
        let c = check(&t, &rules(), 1000).unwrap();
        assert_eq!(c.scopes, ["a", "b\tc\nd"]);
    }

    /// A claim twice in the payload: the last one counts (as the book
    /// says), for the owner and the expiry alike.
    #[test]
    fn a_duplicate_claim_counts_as_its_last_value() {
        let s = Secret::new(SECRET);
        let mut token = URL_SAFE_NO_PAD.encode(r#"{"alg":"HS256"}"#);
        token.push('.');
        token.push_str(&URL_SAFE_NO_PAD.encode(r#"{"sub":"1","exp":500,"sub":"2","exp":2000}"#));
        let sig = s.sign(Alg::HS256, token.as_bytes()).unwrap();
        token.push('.');
        token.push_str(&URL_SAFE_NO_PAD.encode(sig));
        let c = check(&token, &rules(), 1000).unwrap();
        assert_eq!(c.sub.as_deref(), Some("2"));
        assert_eq!(c.valid_until, 2030);
    }

    #[test]
    fn a_signed_token_gives_its_claims_and_scopes_in_both_spellings() {
        let t = hs256(json!({"sub": "42", "exp": 2000, "scope": "a b", "tenant": 7}));
        let c = check(&t, &rules(), 1000).unwrap();
        assert_eq!(c.sub.as_deref(), Some("42"));
        assert_eq!(c.scopes, ["a", "b"]);
        assert_eq!(
            c.owners,
            [
                OwnerClaim::Owner("42".into()),
                OwnerClaim::Owner("7".into())
            ]
        );
        assert_eq!((c.valid_from, c.valid_until), (0, 2030));
        let mut r = rules();
        r.scope_claim = "scp".into();
        let t = hs256(json!({"exp": 2000, "scp": ["x", "y"]}));
        assert_eq!(check(&t, &r, 1000).unwrap().scopes, ["x", "y"]);
        let t = hs256(json!({"exp": 2000, "scp": ["x", 1]}));
        assert_eq!(check(&t, &r, 1000), Err(Invalid::Claims));
    }

    /// `exp` and `nbf` at the leeway's edge, to the second.
    #[test]
    fn exp_and_nbf_hold_to_the_edge_of_the_leeway() {
        let t = hs256(json!({"exp": 1000, "nbf": 900}));
        assert!(check(&t, &rules(), 1029).is_ok());
        assert_eq!(check(&t, &rules(), 1030), Err(Invalid::Expired));
        assert!(check(&t, &rules(), 870).is_ok());
        assert_eq!(check(&t, &rules(), 869), Err(Invalid::NotYetValid));
        // Type confusion: a string where a number belongs is refused.
        let t = hs256(json!({"exp": 1000, "nbf": "99999999999"}));
        assert_eq!(check(&t, &rules(), 950), Err(Invalid::Claims));
        let t = hs256(json!({"exp": "99999999999"}));
        assert_eq!(check(&t, &rules(), 950), Err(Invalid::Claims));
        let t = hs256(json!({"sub": "x"}));
        assert_eq!(check(&t, &rules(), 950), Err(Invalid::Claims));
        let t = hs256(json!({"exp": 1000.9}));
        assert!(check(&t, &rules(), 1029).is_ok());
    }

    #[test]
    fn issuer_and_audience_are_exact_and_an_unasked_audience_is_refused() {
        let mut r = rules();
        let t = hs256(json!({"exp": 2000, "aud": "api"}));
        assert_eq!(check(&t, &r, 1000), Err(Invalid::UnexpectedAudience));
        r.audience = Some("api".into());
        assert!(check(&t, &r, 1000).is_ok());
        let t = hs256(json!({"exp": 2000, "aud": ["x", "api"]}));
        assert!(check(&t, &r, 1000).is_ok());
        let t = hs256(json!({"exp": 2000, "aud": ["x"]}));
        assert_eq!(check(&t, &r, 1000), Err(Invalid::Audience));
        let t = hs256(json!({"exp": 2000}));
        assert_eq!(check(&t, &r, 1000), Err(Invalid::NoAudience));
        r.audience = None;
        r.issuer = Some("https://idp".into());
        let t = hs256(json!({"exp": 2000, "iss": "https://idp"}));
        assert!(check(&t, &r, 1000).is_ok());
        let t = hs256(json!({"exp": 2000, "iss": "https://evil"}));
        assert_eq!(check(&t, &r, 1000), Err(Invalid::Issuer));
    }

    /// The 401's message for each refusal of the claims: the cause, what
    /// the token holds, the fix; never the token.
    #[test]
    fn refusals_of_the_claims_say_what_the_token_holds_and_the_fix() {
        let why = |claims: Value, r: &Rules, now: u64| {
            let t = hs256(claims);
            let p = parse(t.as_bytes(), 8192).unwrap();
            let invalid = super::claims(&p, r, now).unwrap_err();
            let text = explain(&p, r, now, invalid).unwrap_or_else(|| invalid.message().into());
            assert!(!text.contains(&t[..20]) && !text.contains(t.split('.').nth(1).unwrap()));
            (invalid, text)
        };
        let mut r = rules();
        r.audience = Some("bloomgate".into());
        // Keycloak's default: aud "account".
        let (i, text) = why(json!({"exp": 2000, "aud": "account"}), &r, 1000);
        assert_eq!(i, Invalid::Audience);
        for says in [
            "\"account\"",
            "auth.audience",
            "\"bloomgate\"",
            "Audience mapper",
        ] {
            assert!(text.contains(says), "{says}: {text}");
        }
        let (i, text) = why(json!({"exp": 2000, "aud": ["account", "broker"]}), &r, 1000);
        assert_eq!(i, Invalid::Audience);
        assert!(text.contains(r#"["account","broker"]"#), "{text}");
        let (i, text) = why(json!({"exp": 2000}), &r, 1000);
        assert_eq!(i, Invalid::NoAudience);
        assert!(
            text.contains("no aud") && text.contains("\"bloomgate\""),
            "{text}"
        );
        r.audience = None;
        let (i, text) = why(json!({"exp": 2000, "aud": "account"}), &r, 1000);
        assert_eq!(i, Invalid::UnexpectedAudience);
        assert!(text.contains("auth.audience is not set"), "{text}");
        // Expired, by how long; not valid yet, for how long.
        let (i, text) = why(json!({"exp": 1000}), &r, 1000 + 3 * 3600 + 30);
        assert_eq!(i, Invalid::Expired);
        assert!(
            text.contains("expired 3h 30s ago") && text.contains("30 s"),
            "{text}"
        );
        let (i, text) = why(json!({"exp": 9000, "nbf": 2030}), &r, 1000);
        assert_eq!(i, Invalid::NotYetValid);
        assert!(text.contains("valid only in 16m 40s"), "{text}");
        // An issuer that differs by its trailing slash says so.
        r.issuer = Some("https://tenant.eu.auth0.com/".into());
        let (i, text) = why(
            json!({"exp": 2000, "iss": "https://tenant.eu.auth0.com"}),
            &r,
            1000,
        );
        assert_eq!(i, Invalid::Issuer);
        assert!(text.contains("trailing slash"), "{text}");
        let (_, text) = why(json!({"exp": 2000}), &r, 1000);
        assert!(text.contains("no iss"), "{text}");
        r.issuer = None;
        // Which claim is malformed, and what it holds.
        let (i, text) = why(json!({"sub": "1"}), &r, 1000);
        assert_eq!(i, Invalid::Claims);
        assert!(text.contains("no exp"), "{text}");
        let (_, text) = why(json!({"exp": "2000"}), &r, 1000);
        assert!(text.contains("exp is a string, \"2000\""), "{text}");
        let (_, text) = why(json!({"exp": 2000, "sub": ["a"]}), &r, 1000);
        assert!(text.contains("sub is an array"), "{text}");
        let (_, text) = why(json!({"exp": 2000, "scope": {"a": 1}}), &r, 1000);
        assert!(
            text.contains("\"scope\" (auth.scope_claim) is an object"),
            "{text}"
        );
        // A long value is cut short.
        let (_, text) = why(json!({"exp": 2000, "aud": "x".repeat(5000)}), &r, 1000);
        assert!(text.len() < 600 && text.contains('…'), "{}", text.len());
    }

    #[test]
    fn hostile_shapes_are_refused_without_a_panic() {
        let ok = hs256(json!({"exp": 2000}));
        let parts: Vec<&str> = ok.split('.').collect();
        let enc = |v: &str| URL_SAFE_NO_PAD.encode(v);
        let cases: Vec<(String, Invalid)> = vec![
            ("a".repeat(9000), Invalid::TooLong),
            (String::new(), Invalid::Malformed),
            ("..".into(), Invalid::Malformed),
            ("a.b".into(), Invalid::Malformed),
            ("a.b.c.d".into(), Invalid::Malformed),
            (
                format!("{}=.{}.{}", parts[0], parts[1], parts[2]),
                Invalid::Malformed,
            ),
            (
                format!("{}.{}.{}", enc("{\"alg\":\"none\"}"), parts[1], ""),
                Invalid::Algorithm,
            ),
            (
                format!("{}.{}.{}", enc("{\"alg\":\"HS999\"}"), parts[1], parts[2]),
                Invalid::Algorithm,
            ),
            (
                format!(
                    "{}.{}.{}",
                    enc("{\"alg\":\"HS256\",\"alg\":\"none\"}"),
                    parts[1],
                    parts[2]
                ),
                Invalid::Malformed,
            ),
            (
                format!(
                    "{}.{}.{}",
                    enc("{\"alg\":\"HS256\",\"crit\":[\"exp\"]}"),
                    parts[1],
                    parts[2]
                ),
                Invalid::Malformed,
            ),
            // Nesting in a header member nobody reads is skipped by
            // serde_json without recursion: the signature decides.
            (
                format!(
                    "{}.{}.{}",
                    enc(&format!(
                        "{{\"alg\":\"HS256\",\"x\":{}1{}}}",
                        "[".repeat(300),
                        "]".repeat(300)
                    )),
                    parts[1],
                    parts[2]
                ),
                Invalid::Signature,
            ),
            (
                format!(
                    "{}.{}.{}",
                    enc(&format!(
                        "{{\"alg\":\"HS256\",\"kid\":{}1{}}}",
                        "[".repeat(300),
                        "]".repeat(300)
                    )),
                    parts[1],
                    parts[2]
                ),
                Invalid::Malformed,
            ),
            (
                format!("{}.{}.{}", enc("[]"), parts[1], parts[2]),
                Invalid::Malformed,
            ),
            (
                format!("{}.{}.{}", parts[0], parts[1], "AAAA"),
                Invalid::Signature,
            ),
            (
                format!("{}.{}.{}", parts[0], parts[1], "!!!"),
                Invalid::Malformed,
            ),
        ];
        for (token, want) in cases {
            assert_eq!(
                check(&token, &rules(), 1000).err(),
                Some(want),
                "{token:.80}"
            );
        }
    }
}
