//! Access control over real sockets and a real database: bearer JWTs
//! (HS256, RS256, ES256, EdDSA, keys made here), API keys, scopes, row
//! ownership on the key and on another column, per-caller rate limits and
//! their fields, hostile tokens, and what refused requests cost Postgres
//! (nothing). The key sets themselves (a JWKS URL rotated, emptied, taken
//! down; a base64 secret): `tests/it/auth/keys.rs`.

use crate::common;
use crate::support;

use tokio::net::TcpListener;

use bloomgate::auth::jwt::{self, Alg};
use bloomgate::config::ForwardedHeader;
use bloomgate::resource::RequestOutcome;
use common::*;
use serde_json::{Value, json};
use support::*;

#[tokio::test]
async fn every_algorithm_verifies_and_authenticated_rows_are_private_with_etags() {
    let db = seeded().await;
    let keys = Signers::new();
    let set = json!({"keys": [keys.jwk(Alg::RS256, "rsa"), keys.jwk(Alg::ES256, "ec"), keys.jwk(Alg::EdDSA, "ed")]});
    let file = jwks_file(&set);
    let cfg = auth_config(
        &db,
        "",
        &format!(
            "jwt_secret = \"{SECRET}\"\njwks_file = \"{}\"",
            file.display()
        ),
    );
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    let claims = claims("1", "users:read");
    for (alg, kid) in [
        (Alg::HS256, None),
        (Alg::RS256, Some("rsa")),
        (Alg::ES256, Some("ec")),
        (Alg::EdDSA, Some("ed")),
        // Without a kid: the only key of its algorithm.
        (Alg::ES256, None),
    ] {
        let token = keys.sign(alg, kid, &claims);
        for round in 0..2 {
            let r = c.bearer("/private/users/3", &token).await;
            assert_eq!(r.status(), 200, "{alg:?} {kid:?} round {round}");
            assert!(
                h(&r, "cache-control").starts_with("private, "),
                "{}",
                h(&r, "cache-control")
            );
            let etag = h(&r, "etag").to_string();
            let body: Value = r.json().await.unwrap();
            assert_eq!(body["id"], 3);
            let r = c
                .get(
                    "/private/users/3",
                    &[
                        ("authorization", &format!("Bearer {token}")),
                        ("if-none-match", &etag),
                    ],
                )
                .await;
            assert_eq!(r.status(), 304);
            assert!(h(&r, "cache-control").starts_with("private, "));
        }
    }
    // The public resource on the same table is as it was.
    let r = c.get("/users/3", &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(h(&r, "cache-control"), "max-age=0, stale-if-error=300");
    // A token verified once is served from the cache after.
    let v = gw.auth.view();
    assert!(v.token_cache.hits >= 5, "{:?}", v.token_cache.hits);
    served.shutdown().await.unwrap();
    let _ = std::fs::remove_file(file);
}

#[tokio::test]
async fn missing_invalid_and_insufficient_credentials_get_rfc_6750_answers() {
    let db = seeded().await;
    let keys = Signers::new();
    let keyfile = api_keys_file();
    let cfg = auth_config(
        &db,
        "",
        &format!(
            "jwt_secret = \"{SECRET}\"\napi_keys_file = \"{}\"",
            keyfile.display()
        ),
    );
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);

    let r = c.get("/private/users/3", &[]).await;
    assert_eq!(r.status(), 401);
    assert_eq!(h(&r, "www-authenticate"), "Bearer realm=\"bloomgate\"");
    assert_eq!(h(&r, "cache-control"), "no-store");
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        (&body["error"], &body["reason"]),
        (&json!("unauthorized"), &json!("missing"))
    );

    let expired = keys.sign(
        Alg::HS256,
        None,
        &json!({"sub": "1", "scope": "users:read", "exp": now() - 3600}),
    );
    let r = c.bearer("/private/users/3", &expired).await;
    assert_eq!(r.status(), 401);
    assert_eq!(
        h(&r, "www-authenticate"),
        "Bearer realm=\"bloomgate\", error=\"invalid_token\""
    );
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], "invalid_token");
    // The cause, and by how long (the clock may tick between signing
    // and checking).
    assert_eq!(body["reason"], "expired");
    let message = body["message"].as_str().unwrap();
    assert!(message.starts_with("the token expired 1h"), "{message}");

    let unscoped = keys.sign(Alg::HS256, None, &claims("1", "other"));
    let r = c.bearer("/private/users/3", &unscoped).await;
    assert_eq!(r.status(), 403);
    assert_eq!(
        h(&r, "www-authenticate"),
        "Bearer realm=\"bloomgate\", error=\"insufficient_scope\", scope=\"users:read\""
    );
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], "insufficient_scope");
    assert_eq!(body["reason"], "insufficient_scope");
    assert_eq!(
        body["message"],
        "the credential lacks \"users:read\", which this resource requires (a token's \
         scopes are read from its claim \"scope\", auth.scope_claim)"
    );

    // API keys: in X-API-Key, with their own scopes.
    let r = c.get("/keyed/users/3", &[("x-api-key", API_KEY)]).await;
    assert_eq!(r.status(), 200);
    assert!(h(&r, "cache-control").starts_with("private, "));
    let r = c.get("/keyed/users/3", &[("x-api-key", WEAK_KEY)]).await;
    assert_eq!(r.status(), 403);
    let r = c
        .get("/keyed/users/3", &[("x-api-key", "not-a-key-0123456789")])
        .await;
    assert_eq!(r.status(), 401);
    assert_eq!(
        h(&r, "www-authenticate"),
        "ApiKey realm=\"bloomgate\", header=\"X-API-Key\", error=\"invalid_key\""
    );
    // A bearer token is not an API key, and the other way round.
    let good = keys.sign(Alg::HS256, None, &claims("1", "users:read"));
    assert_eq!(c.bearer("/keyed/users/3", &good).await.status(), 401);
    assert_eq!(c.bearer("/private/users/3", API_KEY).await.status(), 401);
    // `any` takes either, not both at once.
    assert_eq!(c.bearer("/any/users/3", &good).await.status(), 200);
    assert_eq!(
        c.get("/any/users/3", &[("x-api-key", WEAK_KEY)])
            .await
            .status(),
        200
    );
    let r = c
        .get(
            "/any/users/3",
            &[
                ("x-api-key", WEAK_KEY),
                ("authorization", &format!("Bearer {good}")),
            ],
        )
        .await;
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "invalid_request");
    let r = c.get("/any/users/3", &[]).await;
    assert_eq!(
        h(&r, "www-authenticate"),
        "Bearer realm=\"bloomgate\", ApiKey realm=\"bloomgate\", header=\"X-API-Key\""
    );
    // A malformed key is 400 whoever asks (parse comes first).
    assert_eq!(c.get("/private/users/abc", &[]).await.status(), 400);
    // HEAD goes through axum's router, with the same checks.
    let head = |t: Option<&str>| {
        let mut req = c.http.head(format!("{}/private/users/3", c.base));
        if let Some(t) = t {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    assert_eq!(head(None).await.unwrap().status(), 401);
    let r = head(Some(&good)).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(h(&r, "cache-control").starts_with("private, "));

    // The counts, per resource and by reason.
    let p = gw.resource("private_users").unwrap();
    assert_eq!(p.stats.count(RequestOutcome::Unauthorized), 4);
    assert_eq!(p.stats.count(RequestOutcome::Forbidden), 1);
    let v = gw.auth.view();
    assert_eq!(v.failures["expired"], 1);
    assert_eq!(v.failures["insufficient_scope"], 2);
    assert_eq!(v.failures["unknown_api_key"], 1);
    assert_eq!(v.failures["missing"], 4);
    assert_eq!(v.failures["two_credentials"], 1);
    served.shutdown().await.unwrap();
    let _ = std::fs::remove_file(keyfile);
}

/// Tokens no gateway should take, each answered 401 at once: nothing is
/// parsed past what refuses it, nothing panics, the server goes on.
#[tokio::test]
async fn hostile_tokens_are_refused_with_401_and_no_panic() {
    let db = seeded().await;
    let keys = Signers::new();
    let set = json!({"keys": [keys.jwk(Alg::RS256, "rsa")]});
    let file = jwks_file(&set);
    // No jwt_secret: HS256 has no key at all here.
    let cfg = auth_config(&db, "", &format!("jwks_file = \"{}\"", file.display()));
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    let good = keys.sign(Alg::RS256, Some("rsa"), &claims("1", "users:read"));
    assert_eq!(c.bearer("/private/users/3", &good).await.status(), 200);
    let parts: Vec<&str> = good.split('.').collect();
    let enc = |v: &str| b64(v.as_bytes());
    // Algorithm confusion: HS256 "signed" with the RSA key's public bytes.
    let rsa_public = keys.rsa.public().as_ref().to_vec();
    let confused = jwt::encode(
        &json!({"alg": "HS256", "kid": "rsa"}),
        &claims("1", "users:read"),
        |m| jwt::Secret::new(&rsa_public).sign(Alg::HS256, m).unwrap(),
    );
    let bomb = format!(
        "{}.{}.{}",
        enc(&format!(
            "{{\"alg\":\"RS256\",\"kid\":\"rsa\",\"x\":{}1{}}}",
            "[".repeat(250),
            "]".repeat(250)
        )),
        parts[1],
        parts[2]
    );
    let cases = [
        (
            "alg none",
            format!("{}.{}.", enc("{\"alg\":\"none\"}"), parts[1]),
        ),
        ("HS256 with the RSA public key", confused),
        (
            "unknown alg",
            format!(
                "{}.{}.{}",
                enc("{\"alg\":\"RS1024\",\"kid\":\"rsa\"}"),
                parts[1],
                parts[2]
            ),
        ),
        (
            "unknown kid",
            keys.sign(Alg::RS256, Some("nobody"), &claims("1", "users:read")),
        ),
        ("100 kB", "a".repeat(100_000)),
        ("bad base64", format!("{}.{}.{}", parts[0], "%%%", parts[2])),
        (
            "padding",
            format!("{}=.{}.{}", parts[0], parts[1], parts[2]),
        ),
        ("JSON bomb in the header", bomb),
        (
            "signature of another token",
            format!(
                "{}.{}.{}",
                parts[0],
                enc("{\"sub\":\"2\",\"exp\":99999999999}"),
                parts[2]
            ),
        ),
        ("two parts", format!("{}.{}", parts[0], parts[1])),
    ];
    for (what, token) in &cases {
        let r = c.bearer("/private/users/3", token).await;
        assert_eq!(r.status(), 401, "{what}");
        assert!(
            h(&r, "www-authenticate").contains("invalid_token"),
            "{what}"
        );
        let text = r.text().await.unwrap();
        assert!(
            text.len() < 300 && !text.contains(&token[..token.len().min(40)]),
            "{what}: {text}"
        );
    }
    assert_eq!(c.get("/healthz", &[]).await.status(), 200);
    assert_eq!(c.bearer("/private/users/3", &good).await.status(), 200);
    let v = gw.auth.view();
    for reason in [
        "algorithm",
        "unknown_key",
        "too_long",
        "malformed",
        "signature",
    ] {
        assert!(v.failures[reason] >= 1, "{reason}: {:?}", v.failures);
    }
    served.shutdown().await.unwrap();
    let _ = std::fs::remove_file(file);
}

/// `exp` and `nbf` a few seconds inside and outside the leeway (30 s): the
/// margins absorb the second that may tick between signing and checking.
#[tokio::test]
async fn clock_skew_is_allowed_up_to_the_leeway_and_no_further() {
    let db = seeded().await;
    let keys = Signers::new();
    let cfg = auth_config(
        &db,
        "",
        &format!("jwt_secret = \"{SECRET}\"\nleeway = \"30s\""),
    );
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    let t = now();
    let token = |exp: u64, nbf: Option<u64>| {
        let mut cl = json!({"sub": "1", "scope": "users:read", "exp": exp});
        if let Some(n) = nbf {
            cl["nbf"] = json!(n);
        }
        keys.sign(Alg::HS256, None, &cl)
    };
    for (what, tok, want) in [
        ("expired 27 s ago", token(t - 27, None), 200),
        ("expired 33 s ago", token(t - 33, None), 401),
        ("valid from in 27 s", token(t + 600, Some(t + 27)), 200),
        ("valid from in 33 s", token(t + 600, Some(t + 33)), 401),
    ] {
        let r = c.bearer("/private/users/3", &tok).await;
        assert_eq!(r.status(), want, "{what}");
    }
    served.shutdown().await.unwrap();
}

/// What a refused request costs Postgres: nothing. Every gateway backend's
/// last state change (`pg_stat_activity`, live) and the pool's query count
/// stay as they were through 1,000 requests for absent keys without a
/// credential; so do the filter's and the caches' counts.
#[tokio::test]
async fn a_thousand_unauthenticated_requests_for_absent_keys_cost_the_database_nothing() {
    let db = seeded().await;
    let cfg = auth_config(
        &db,
        "freshness = \"off\"\n[filter]\nrebuild_interval = \"0s\"",
        &format!("jwt_secret = \"{SECRET}\""),
    );
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    // Activity of every other backend on the test database, as Postgres
    // sees it now (not the statistics, which are flushed lazily), read on
    // one connection of our own.
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    let mut activity = async || {
        sqlx::query_as::<_, (i32, Option<String>, String)>(
            "SELECT pid, state_change::text, coalesce(query, '') FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid() ORDER BY pid",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap()
    };
    let p = gw.resource("private_users").unwrap();
    let (q0, a0, f0) = (
        queries(&gw),
        activity().await,
        p.stats.count(RequestOutcome::Filtered),
    );
    for i in 0..1000 {
        let r = c
            .get(&format!("/private/users/{}", 1_000_000 + i), &[])
            .await;
        assert_eq!(r.status(), 401);
    }
    assert_eq!(queries(&gw), q0, "the gateway sent no query");
    assert_eq!(
        activity().await,
        a0,
        "no backend of the gateway did anything"
    );
    assert_eq!(
        p.stats.count(RequestOutcome::Filtered),
        f0,
        "the filter was not asked"
    );
    assert_eq!(p.cache_entries(), (0, 0));
    assert_eq!(p.stats.count(RequestOutcome::Unauthorized), 1000);
    served.shutdown().await.unwrap();
}

/// Row ownership on the key (`/me/{id}`) and on another column
/// (`/my/articles/{id}`, `author_id`): another owner's row is a 404 that
/// reads exactly like the 404 of a key that does not exist.
#[tokio::test]
async fn another_owners_row_is_a_404_indistinguishable_from_an_absent_key() {
    let db = seeded().await;
    let keys = Signers::new();
    let cfg = auth_config(&db, "", &format!("jwt_secret = \"{SECRET}\""));
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    let seven = keys.sign(Alg::HS256, None, &claims("7", ""));

    // On the key.
    let r = c.bearer("/me/7", &seven).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["id"], 7);
    let other = described(c.bearer("/me/8", &seven).await).await;
    let absent = described(c.bearer("/me/999999", &seven).await).await;
    assert_eq!(other.0, 404);
    assert_eq!(other, absent, "another owner's key reads as an absent one");
    let me = gw.resource("me").unwrap();
    assert_eq!(
        me.stats.count(RequestOutcome::Forbidden),
        2,
        "both refused before the filter"
    );
    assert_eq!(me.stats.count(RequestOutcome::Filtered), 0);

    // On a column read from the cached row.
    let mine = "/my/articles/00000000-0000-0000-0000-000000000007";
    let theirs = "/my/articles/00000000-0000-0000-0000-000000000008";
    for _ in 0..2 {
        let r = c.bearer(mine, &seven).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.json::<Value>().await.unwrap()["author_id"], 7);
    }
    for _ in 0..2 {
        // Loaded, then from the cache: the same answer both times.
        let theirs = described(c.bearer(theirs, &seven).await).await;
        let absent = described(
            c.bearer("/my/articles/00000000-0000-0000-0000-0000000000ff", &seven)
                .await,
        )
        .await;
        assert_eq!(theirs.0, 404);
        assert_eq!(theirs, absent);
        assert!(
            theirs
                .1
                .contains(&("cache-status".into(), "bloomgate; detail=not-found".into()))
        );
    }
    // A token without the owner claim may not read either.
    let nobody = keys.sign(Alg::HS256, None, &json!({"exp": now() + 60}));
    assert_eq!(c.bearer("/me/7", &nobody).await.status(), 403);

    // Not vouched for by the change feed (a resync): rows come from the
    // database past the cache, and the owner check still holds.
    let articles = gw.resource("my_articles").unwrap();
    articles.vouch.open_gap("a test's resync");
    let r = c.bearer(theirs, &seven).await;
    assert_eq!(r.status(), 404);
    assert_eq!(h(&r, "cache-status"), "bloomgate; detail=not-found");
    let r = c.bearer(mine, &seven).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        h(&r, "cache-status"),
        "bloomgate; fwd=bypass; detail=unverified"
    );
    served.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_burst_above_the_rate_limit_is_429_while_another_caller_is_served() {
    let db = seeded().await;
    let keys = Signers::new();
    let cfg = auth_config(&db, "", &format!("jwt_secret = \"{SECRET}\""));
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    let a = keys.sign(Alg::HS256, None, &claims("alice", ""));
    let b = keys.sign(Alg::HS256, None, &claims("bob", ""));
    // 1/s with a burst of 3: the fourth at once is refused.
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let r = c.bearer("/limited/users/3", &a).await;
        statuses.push(r.status().as_u16());
        if r.status() == 429 {
            let retry: u64 = h(&r, "retry-after").parse().unwrap();
            assert!((1..=2).contains(&retry), "{retry}");
            assert_eq!(h(&r, "ratelimit-policy"), "\"limited_users\";q=3;w=3");
            assert!(
                h(&r, "ratelimit").starts_with("\"limited_users\";r=0;t="),
                "{}",
                h(&r, "ratelimit")
            );
            assert_eq!(h(&r, "cache-control"), "no-store");
            assert_eq!(r.json::<Value>().await.unwrap()["error"], "rate_limited");
        }
    }
    assert_eq!(&statuses[..3], &[200, 200, 200]);
    assert!(statuses[3..].iter().all(|s| *s == 429), "{statuses:?}");
    // Bob is another caller: served.
    assert_eq!(c.bearer("/limited/users/3", &b).await.status(), 200);
    // A new token of Alice's is still Alice.
    let a2 = keys.sign(
        Alg::HS256,
        None,
        &json!({"sub": "alice", "exp": now() + 601}),
    );
    assert_eq!(c.bearer("/limited/users/3", &a2).await.status(), 429);
    // A public resource limits by client address.
    let open: Vec<u16> = futures_util::future::join_all(
        (0..4).map(|_| async { c.get("/open/users/3", &[]).await.status().as_u16() }),
    )
    .await;
    assert_eq!(open.iter().filter(|s| **s == 200).count(), 2, "{open:?}");
    assert_eq!(open.iter().filter(|s| **s == 429).count(), 2, "{open:?}");
    assert_eq!(
        gw.resource("limited_users")
            .unwrap()
            .stats
            .count(RequestOutcome::RateLimited),
        3
    );
    served.shutdown().await.unwrap();
}

/// Behind a trusted proxy (here the test itself, from 127.0.0.1), a public
/// resource's rate limit counts each caller its `X-Forwarded-For` names,
/// over a real socket: a client's own entries to the left change nothing,
/// the other header is not read, and from a peer that is not trusted the
/// header is ignored (every caller is then the proxy, as before).
#[tokio::test]
async fn behind_a_trusted_proxy_each_caller_has_its_own_rate_limit() {
    let db = seeded().await;
    let serve = |trusted: &[&str], header: ForwardedHeader| {
        let mut cfg = auth_config(&db, "", &format!("jwt_secret = \"{SECRET}\""));
        cfg.server.trusted_proxies = trusted.iter().map(|t| t.parse().unwrap()).collect();
        cfg.server.forwarded_header = header;
        let gw = gateway(cfg);
        async move { serve_socket(&gw, None).await }
    };
    // `/open/users/{id}`: 1/s, a burst of 2. Four at once, each with its
    // own headers: how many were let through.
    async fn burst(c: &Client, headers: [(&str, &str); 4]) -> usize {
        futures_util::future::join_all(
            headers.map(|(k, v)| async move { c.get("/open/users/3", &[(k, v)]).await.status() }),
        )
        .await
        .iter()
        .filter(|s| **s == 200)
        .count()
    }
    let xff = "x-forwarded-for";
    let trusting = serve(&["127.0.0.1"], ForwardedHeader::XForwardedFor).await;
    let c = Client::new(trusting.addr);
    // One caller, whatever it adds on the left: one burst of 2.
    assert_eq!(
        burst(
            &c,
            [
                (xff, "203.0.113.1"),
                (xff, "198.51.100.77, 203.0.113.1"),
                (xff, "127.0.0.1, 203.0.113.1"),
                (xff, "garbage, 203.0.113.1"),
            ]
        )
        .await,
        2
    );
    // Four callers: each its own burst.
    assert_eq!(
        burst(
            &c,
            [
                (xff, "203.0.113.2"),
                (xff, "203.0.113.3"),
                (xff, "203.0.113.4"),
                (xff, "2001:db8::5"),
            ]
        )
        .await,
        4
    );
    trusting.shutdown().await.unwrap();

    // RFC 7239's header instead: X-Forwarded-For is not read at all.
    let forwarded = serve(&["127.0.0.0/8"], ForwardedHeader::Forwarded).await;
    let c = Client::new(forwarded.addr);
    let fwd = "forwarded";
    assert_eq!(
        burst(
            &c,
            [
                (fwd, "for=203.0.113.2"),
                (fwd, "for=\"203.0.113.3:4711\""),
                (fwd, "for=\"[2001:db8::5]\";proto=https"),
                (fwd, "for=203.0.113.4"),
            ]
        )
        .await,
        4
    );
    assert_eq!(
        burst(
            &c,
            [
                (xff, "203.0.113.12"),
                (xff, "203.0.113.13"),
                (xff, "203.0.113.14"),
                (xff, "203.0.113.15"),
            ]
        )
        .await,
        2,
        "the header the proxies do not write names no one"
    );
    forwarded.shutdown().await.unwrap();

    // Nobody trusted: the header is ignored, everyone is the peer.
    let untrusting = serve(&[], ForwardedHeader::XForwardedFor).await;
    let c = Client::new(untrusting.addr);
    assert_eq!(
        burst(
            &c,
            [
                (xff, "203.0.113.2"),
                (xff, "203.0.113.3"),
                (xff, "203.0.113.4"),
                (xff, "203.0.113.5"),
            ]
        )
        .await,
        2
    );
    untrusting.shutdown().await.unwrap();
}

/// The admin API and the metrics show each resource's rules and its
/// refusals; no token or key appears in them, nor in the log.
#[tokio::test]
async fn refusals_are_counted_in_the_admin_api_and_metrics_and_no_secret_is_shown() {
    let (logs, _guard) = capture_logs();
    let db = seeded().await;
    let keys = Signers::new();
    let keyfile = api_keys_file();
    let cfg = auth_config(
        &db,
        "",
        &format!(
            "jwt_secret = \"{SECRET}\"\napi_keys_file = \"{}\"",
            keyfile.display()
        ),
    );
    let gw = gateway(cfg);
    let admin_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin_addr = admin_listener.local_addr().unwrap();
    let admin_token = "admin-token-0123456789abcdef";
    let served = serve_socket(
        &gw,
        Some(bloomgate::server::Admin {
            listener: admin_listener,
            token: admin_token.into(),
        }),
    )
    .await;
    let c = Client::new(served.addr);
    let expired = keys.sign(Alg::HS256, None, &json!({"sub": "1", "exp": now() - 3600}));
    let good = keys.sign(Alg::HS256, None, &claims("1", "users:read"));
    assert_eq!(c.bearer("/private/users/3", &expired).await.status(), 401);
    assert_eq!(c.bearer("/private/users/3", &good).await.status(), 200);
    assert_eq!(
        c.get("/keyed/users/3", &[("x-api-key", WEAK_KEY)])
            .await
            .status(),
        403
    );
    for _ in 0..4 {
        c.bearer("/limited/users/3", &good).await;
    }
    let admin = Client::new(admin_addr);
    let auth = [("authorization", format!("Bearer {admin_token}"))];
    let auth: Vec<(&str, &str)> = auth.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let stats: Value = admin.get("/admin/stats", &auth).await.json().await.unwrap();
    let by = |name: &str| {
        stats["resources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap()
            .clone()
    };
    let p = by("private_users");
    assert_eq!(p["access"]["auth"], "jwt");
    assert_eq!(p["access"]["scopes"], json!(["users:read"]));
    assert_eq!(p["access"]["unauthorized"], 1);
    assert_eq!(p["requests"]["unauthorized"], 1);
    assert_eq!(by("keyed_users")["access"]["forbidden"], 1);
    assert_eq!(by("limited_users")["access"]["rate_limited"], 1);
    assert_eq!(by("limited_users")["access"]["rate_limit"]["burst"], 3);
    assert_eq!(by("users")["access"]["auth"], "none");
    assert_eq!(stats["auth"]["api_keys"], 2);
    assert_eq!(stats["auth"]["failures"]["expired"], 1);
    let metrics = admin.get("/metrics", &auth).await.text().await.unwrap();
    for line in [
        "bloomgate_requests_total{resource=\"private_users\",outcome=\"unauthorized\"} 1",
        "bloomgate_requests_total{resource=\"keyed_users\",outcome=\"forbidden\"} 1",
        "bloomgate_requests_total{resource=\"limited_users\",outcome=\"rate_limited\"} 1",
        "bloomgate_auth_failures_total{reason=\"expired\"} 1",
    ] {
        assert!(metrics.contains(line), "{line}\n{metrics}");
    }
    served.shutdown().await.unwrap();
    let everything = format!("{stats}\n{metrics}\n{}", logs.text());
    for secret in [SECRET, API_KEY, WEAK_KEY, &good, &expired] {
        assert!(!everything.contains(secret), "a secret was shown");
    }
    let _ = std::fs::remove_file(keyfile);
}

/// The public document declares the schemes, each operation's security
/// and scopes, and the 401, 403 and 429 answers where they can happen.
#[tokio::test]
async fn the_openapi_document_declares_schemes_security_and_refusals() {
    let (_db, served, c) = with_secret().await;
    let doc: Value = c.get("/openapi.json", &[]).await.json().await.unwrap();
    let schemes = &doc["components"]["securitySchemes"];
    assert_eq!(schemes["bearerAuth"]["scheme"], "bearer");
    assert_eq!(schemes["bearerAuth"]["bearerFormat"], "JWT");
    assert_eq!(schemes["apiKey"]["in"], "header");
    assert_eq!(schemes["apiKey"]["name"], "X-API-Key");
    let op = |path: &str| doc["paths"][path]["get"].clone();
    let private = op("/private/users/{id}");
    assert_eq!(private["security"], json!([{"bearerAuth": ["users:read"]}]));
    for status in ["401", "403"] {
        assert!(private["responses"][status].is_object(), "{status}");
    }
    assert!(private["responses"].get("429").is_none());
    assert_eq!(
        op("/any/users/{id}")["security"],
        json!([{"bearerAuth": []}, {"apiKey": []}])
    );
    assert_eq!(
        op("/keyed/users/{id}")["security"],
        json!([{"apiKey": ["users:read"]}])
    );
    let limited = op("/limited/users/{id}");
    assert!(limited["responses"]["429"]["headers"]["Retry-After"].is_object());
    assert!(limited["responses"]["429"]["headers"]["RateLimit"].is_object());
    // Public resources: no security, a 429 only where limited.
    let public = op("/users/{id}");
    assert!(public.get("security").is_none());
    assert!(public["responses"].get("401").is_none());
    assert!(op("/open/users/{id}")["responses"]["429"].is_object());
    served.shutdown().await.unwrap();
}

/// Finding 4: an integer owner has one spelling. A `sub` of `"03"` or
/// `"+3"` owns neither key 3 nor the rows whose owner column is 3.
#[tokio::test]
async fn numeric_owner_claims_count_only_in_canonical_decimal() {
    let (_db, served, c) = with_secret().await;
    let hs = |sub: Value| hs256(&json!({"sub": sub, "exp": now() + 600}));
    assert_eq!(c.bearer("/me/3", &hs(json!("3"))).await.status(), 200);
    assert_eq!(c.bearer("/me/3", &hs(json!(3))).await.status(), 200);
    let article = "/my/articles/00000000-0000-0000-0000-000000000007";
    assert_eq!(c.bearer(article, &hs(json!("7"))).await.status(), 200);
    for lenient in ["03", "+3", "3.0", " 3", "0x3"] {
        assert_eq!(
            c.bearer("/me/3", &hs(json!(lenient))).await.status(),
            404,
            "{lenient:?}"
        );
        let seven = lenient.replace('3', "7");
        assert_eq!(
            c.bearer(article, &hs(json!(seven))).await.status(),
            404,
            "{seven:?}"
        );
    }
    served.shutdown().await.unwrap();
}

/// Convention: a rate-limited resource says its policy on every answer
/// (so a client can pace itself before a 429) and, on every answer the
/// limiter let through, what is left of it.
#[tokio::test]
async fn rate_limited_resources_send_their_policy_always_and_their_state_once_admitted() {
    let (_db, served, c) = with_secret().await;
    let token = hs256(&claims("5", ""));
    let r = c.bearer("/limited/users/3", &token).await;
    assert_eq!(r.status(), 200);
    assert_eq!(h(&r, "ratelimit-policy"), "\"limited_users\";q=3;w=3");
    assert_eq!(h(&r, "ratelimit"), "\"limited_users\";r=2;t=1");
    let r = c.bearer("/limited/users/999999", &token).await;
    assert_eq!(r.status(), 404);
    assert_eq!(h(&r, "ratelimit"), "\"limited_users\";r=1;t=2");
    let r = c.get("/limited/users/3", &[]).await;
    assert_eq!(r.status(), 401);
    assert_eq!(h(&r, "ratelimit-policy"), "\"limited_users\";q=3;w=3");
    assert_eq!(h(&r, "ratelimit"), "", "not counted: no state to tell");
    // A public rate-limited resource too; a resource without a limit says
    // nothing of one.
    let r = c.get("/open/users/3", &[]).await;
    assert_eq!(h(&r, "ratelimit-policy"), "\"open_users\";q=2;w=2");
    assert!(h(&r, "ratelimit").starts_with("\"open_users\";r=1;t="));
    let r = c.get("/users/3", &[]).await;
    assert_eq!((h(&r, "ratelimit-policy"), h(&r, "ratelimit")), ("", ""));
    served.shutdown().await.unwrap();
}

/// Finding 3, decided: on an `owner_column` resource a database that does
/// not answer is 503 for a key the filter passes, whoever owns it, and an
/// absent key stays the filter's 404. Answering 404 instead would tell the
/// owner their row is gone (the false negative this gateway exists not to
/// give); answering 503 for absent keys would make an outage of every key.
/// What it leaves visible, that the filter passed the key, is what the
/// timing already shows (docs/src/access-control.md, "403 or 404 for another owner's row").
#[tokio::test]
async fn an_owner_column_resource_answers_503_never_404_when_the_database_does_not() {
    let db = seeded().await;
    db.add_slow_view().await;
    let resource = r#"
        [[resource]]
        name = "slow_mine"
        route = "/slow/mine/{id}"
        table = "slow_users"
        source_table = "users"
        key_column = "id"
        key_type = "bigint"
        columns = ["id", "name"]
        auth = "jwt"
        owner_claim = "sub"
        owner_column = "name"
    "#;
    let mut cfg = auth_config(
        &db,
        "statement_timeout = \"300ms\"",
        &format!("jwt_secret = \"{SECRET}\""),
    );
    let extra = bloomgate::config::Config::from_toml(&format!(
        "[database]\nurl = \"{}\"\n[auth]\njwt_secret = \"{SECRET}\"\n{resource}",
        db.url
    ))
    .unwrap();
    cfg.resources.extend(extra.resources);
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    let token = hs256(&claims("User 3", ""));
    assert_eq!(c.bearer("/slow/mine/3", &token).await.status(), 200);
    assert_eq!(
        c.bearer("/slow/mine/4", &token).await.status(),
        404,
        "another owner's row"
    );
    db.exec("UPDATE test_delay SET seconds = 2").await;
    for key in [5, 6] {
        let r = c.bearer(&format!("/slow/mine/{key}"), &token).await;
        assert_eq!(r.status(), 503, "another owner's row, not loaded yet");
        assert!(
            !r.text().await.unwrap().contains("User"),
            "nothing of the row"
        );
    }
    let r = c.bearer("/slow/mine/999999", &token).await;
    assert_eq!(
        (r.status().as_u16(), h(&r, "cache-status")),
        (404, "bloomgate; detail=not-found")
    );
    served.shutdown().await.unwrap();
}

/// A composite key whose owner is one of its parts, and callers in
/// several tenants: an owner claim that is an array owns the rows of any
/// of its owners, an empty one owns nothing, and another tenant's row is
/// answered exactly as an absent key. A claim of the wrong type is named
/// with what it holds, and the challenge names no scope.
#[tokio::test]
async fn owners_on_a_key_part_and_callers_in_several_tenants() {
    let db = seeded().await;
    db.exec(
        "CREATE TABLE orders (tenant_id bigint, order_no bigint, item text NOT NULL,
                              PRIMARY KEY (tenant_id, order_no));
         INSERT INTO orders VALUES (7, 1, 'seven'), (3, 1, 'three'), (9, 1, 'nine');",
    )
    .await;
    let resource = r#"
        [[resource]]
        name = "tenant_orders"
        route = "/tenants/{tenant_id}/orders/{order_no}"
        table = "orders"
        key_column = ["tenant_id", "order_no"]
        key_type = ["bigint", "bigint"]
        columns = ["tenant_id", "order_no", "item"]
        auth = "jwt"
        owner_claim = "tenant"
        owner_column = "tenant_id"

        [[resource]]
        name = "orders_by_item"
        route = "/by-item/{tenant_id}/{order_no}"
        table = "orders"
        key_column = ["tenant_id", "order_no"]
        key_type = "bigint"
        columns = ["tenant_id", "order_no", "item"]
        auth = "jwt"
        owner_claim = "tenant"
        owner_column = "item"
    "#;
    let mut cfg = auth_config(&db, "", &format!("jwt_secret = \"{SECRET}\""));
    let extra = bloomgate::config::Config::from_toml(&format!(
        "[database]\nurl = \"{}\"\n[auth]\njwt_secret = \"{SECRET}\"\n{resource}",
        db.url
    ))
    .unwrap();
    cfg.resources.extend(extra.resources);
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    let hs = |tenant: Value| hs256(&json!({"sub": "u", "tenant": tenant, "exp": now() + 600}));
    let of = |t: u32| format!("/tenants/{t}/orders/1");

    let both = hs(json!([7, "3"]));
    for (t, item) in [(7, "seven"), (3, "three")] {
        let r = c.bearer(&of(t), &both).await;
        assert_eq!(r.status(), 200, "tenant {t}");
        assert!(r.text().await.unwrap().contains(item));
    }
    // Another tenant's row reads as an absent key of one's own.
    let (status, _, other) = described(c.bearer(&of(9), &both).await).await;
    let (_, _, absent) = described(c.bearer("/tenants/7/orders/404", &both).await).await;
    assert_eq!((status, &other), (404, &absent));
    // One owner as before; none in an empty array.
    assert_eq!(c.bearer(&of(7), &hs(json!(7))).await.status(), 200);
    assert_eq!(c.bearer(&of(3), &hs(json!(7))).await.status(), 404);
    for t in [7, 3, 9] {
        assert_eq!(c.bearer(&of(t), &hs(json!([]))).await.status(), 404);
    }
    // A claim that names no owner: 403 naming the claim and what it
    // holds; no scope would help, and none is named.
    for (claim, holds) in [
        (json!({"id": 7}), "an object"),
        (json!([7, {"id": 3}]), "an array"),
        (json!(7.5), "a number"),
    ] {
        let r = c.bearer(&of(7), &hs(claim.clone())).await;
        assert_eq!(r.status(), 403, "{claim}");
        let challenge = h(&r, "www-authenticate").to_string();
        assert!(!challenge.contains("scope="), "{challenge}");
        let body = r.text().await.unwrap();
        assert!(body.contains("\\\"tenant\\\""), "{body}");
        assert!(body.contains(holds), "{claim}: {body}");
    }

    // Several owners on an owner column read from the row, too.
    let items = hs(json!(["seven", "three"]));
    for (t, status) in [(7, 200), (3, 200), (9, 404)] {
        let path = format!("/by-item/{t}/1");
        assert_eq!(c.bearer(&path, &items).await.status(), status, "{t}");
    }
    served.shutdown().await.unwrap();
}
