//! The access check of a credential seen before allocates nothing: a
//! keyed hash, one read of the verified cache, the scope bits. Counted
//! exactly by a global allocator that counts this thread's allocations
//! (this test binary's own: nothing else runs in it).

use std::time::Instant;

use axum::http::{HeaderMap, HeaderValue};
use bloomgate::auth::jwt::{self, Alg};
use bloomgate::auth::{Auth, Caller};
use bloomgate::config::Config;
use bloomgate::key::Key;
use bloomgate::key::compare::Comparison;

#[path = "common/counting.rs"]
mod counting;
use counting::allocations;

#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

const SECRET: &str = "alloc-test-secret-0123456789abcdef";
const KEY: &str = "alloc-test-api-key-0123456789";

#[test]
fn a_warm_check_allocates_nothing() {
    let dir = std::env::temp_dir().join(format!("bloomgate-alloc-{:x}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys.toml");
    std::fs::write(
        &keys,
        format!("[[key]]\nname = \"k\"\nkey = \"{KEY}\"\nscopes = [\"r\"]\n"),
    )
    .unwrap();
    let config = Config::from_toml(&format!(
        r#"
        [auth]
        jwt_secret = "{SECRET}"
        api_keys_file = "{}"
        [[resource]]
        name = "me"
        route = "/me/{{id}}"
        table = "users"
        key_column = "id"
        key_type = "bigint"
        columns = ["id"]
        auth = "jwt"
        scopes = ["r"]
        owner_claim = "sub"
        rate_limit = "1000000/s"
        [[resource]]
        name = "keyed"
        route = "/keyed/{{id}}"
        table = "users"
        key_column = "id"
        key_type = "bigint"
        columns = ["id"]
        auth = "api_key"
        scopes = ["r"]
        rate_limit = "1000000/s"
        "#,
        keys.display()
    ))
    .unwrap();
    let files = bloomgate::auth::key_files::KeyFiles::read(&config.auth, "config").unwrap();
    let auth = Auth::new(&config, &files);
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let secret = jwt::Secret::new(SECRET.as_bytes());
    let token = jwt::encode(
        &serde_json::json!({"alg": "HS256"}),
        &serde_json::json!({"sub": "7", "scope": "r", "exp": exp}),
        |m| secret.sign(Alg::HS256, m).unwrap(),
    );
    let mut bearer = HeaderMap::new();
    bearer.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
    );
    let mut api = HeaderMap::new();
    api.insert("x-api-key", HeaderValue::from_static(KEY));
    let key = Key::Int(7);
    for (p, headers) in [(&auth.policies[0], &bearer), (&auth.policies[1], &api)] {
        // The first check verifies and stores the credential.
        let first = auth.check(p, headers, None, Instant::now());
        assert!(matches!(first, Ok((Caller::Fresh(_), _))));
        drop(first);
        let before = allocations();
        for _ in 0..1000 {
            let (caller, _) = auth.check(p, headers, None, Instant::now()).unwrap();
            assert!(matches!(caller, Caller::Held(_)));
            if let Some(v) = caller.verified()
                && headers.contains_key("authorization")
            {
                assert!(auth.owns_key(p, v, &key, &Comparison::Bytes));
            }
        }
        assert_eq!(
            allocations() - before,
            0,
            "allocations in 1,000 warm checks"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}
