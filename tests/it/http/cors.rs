//! CORS (`[server.cors]`, `http::cors`) over real sockets: a preflight
//! without credentials answered before the access checks, listed and
//! unlisted origins on every kind of answer, `Vary: Origin` as an HTTP
//! cache in front reads it, `OPTIONS *`, the OpenAPI document, and
//! nothing changed while CORS is off.

use crate::common;
use crate::support;

use bloomgate::config::CorsConfig;
use bloomgate::resource::RequestOutcome;
use common::*;
use reqwest::Method;
use serde_json::Value;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const APP: &str = "https://app.example.com";
const EVIL: &str = "https://evil.example.com";

/// The auth tests' resources with `jwt_secret`, served with CORS for
/// [`APP`] (or off).
async fn served(cors: bool) -> (TestDb, std::sync::Arc<bloomgate::gateway::Gateway>, Served) {
    let db = seeded().await;
    let mut cfg = auth_config(&db, "", &format!("jwt_secret = \"{SECRET}\""));
    if cors {
        cfg.server.cors = CorsConfig {
            allow_origins: vec![APP.into()],
            ..CorsConfig::default()
        };
    }
    let gw = gateway(cfg);
    let s = serve_socket(&gw, None).await;
    (db, gw, s)
}

async fn send(
    c: &Client,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut req = c.http.request(method, format!("{}{path}", c.base));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.unwrap()
}

/// Every `Vary` value of a response, lower-cased, one per list element.
fn varies(r: &reqwest::Response) -> Vec<String> {
    r.headers()
        .get_all("vary")
        .iter()
        .flat_map(|v| v.to_str().unwrap().split(','))
        .map(|v| v.trim().to_ascii_lowercase())
        .collect()
}

fn cors_headers(r: &reqwest::Response) -> Vec<String> {
    r.headers()
        .keys()
        .map(|k| k.as_str().to_string())
        .filter(|k| k.starts_with("access-control-"))
        .collect()
}

/// A browser's preflight carries no credential: it is answered 204 by the
/// front layer, whatever the resource's `auth`, and no access check runs
/// (nothing is refused or counted). The request it announces is then
/// checked as any other, and its answer, a 401 included, is readable.
#[tokio::test]
async fn a_preflight_without_credentials_is_answered_before_the_access_checks() {
    let (_db, gw, s) = served(true).await;
    let c = Client::new(s.addr);
    let pre = send(
        &c,
        Method::OPTIONS,
        "/private/users/3",
        &[
            ("origin", APP),
            ("access-control-request-method", "GET"),
            (
                "access-control-request-headers",
                "authorization, if-none-match",
            ),
        ],
    )
    .await;
    assert_eq!(pre.status(), 204);
    assert_eq!(h(&pre, "access-control-allow-origin"), APP);
    assert_eq!(h(&pre, "access-control-allow-methods"), "GET, HEAD");
    let allowed = h(&pre, "access-control-allow-headers").to_ascii_lowercase();
    assert!(
        allowed.contains("authorization") && allowed.contains("if-none-match"),
        "{allowed}"
    );
    assert_eq!(h(&pre, "access-control-max-age"), "600");
    assert!(varies(&pre).contains(&"origin".to_string()));
    assert!(h(&pre, "www-authenticate").is_empty());
    let p = gw.resource("private_users").unwrap();
    assert_eq!(p.stats.count(RequestOutcome::Unauthorized), 0);
    assert!(gw.auth.view().failures.values().all(|n| *n == 0));

    // The request itself, with its token: the row, readable by the page.
    let token = hs256(&claims("1", "users:read"));
    let bearer = format!("Bearer {token}");
    let r = send(
        &c,
        Method::GET,
        "/private/users/3",
        &[("origin", APP), ("authorization", &bearer)],
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(h(&r, "access-control-allow-origin"), APP);
    assert_eq!(
        h(&r, "access-control-expose-headers"),
        "ETag, Cache-Status, Retry-After, RateLimit, RateLimit-Policy"
    );
    assert!(h(&r, "access-control-allow-credentials").is_empty());
    // Without it: a 401 the page can read, reason and all.
    let r = send(&c, Method::GET, "/private/users/3", &[("origin", APP)]).await;
    assert_eq!(r.status(), 401);
    assert_eq!(h(&r, "access-control-allow-origin"), APP);
    assert_eq!(r.json::<Value>().await.unwrap()["reason"], "missing");

    // Another origin's preflight is no preflight: the 405 it always was.
    let pre = send(
        &c,
        Method::OPTIONS,
        "/private/users/3",
        &[("origin", EVIL), ("access-control-request-method", "GET")],
    )
    .await;
    assert_eq!(pre.status(), 405);
    assert_eq!(h(&pre, "allow"), "GET,HEAD");
    assert!(cors_headers(&pre).is_empty(), "{:?}", cors_headers(&pre));
    s.shutdown().await.unwrap();
}

/// What is asked, how, with which headers, and the status it gets.
type Case<'a> = (&'a str, Method, &'a str, Vec<(&'a str, &'a str)>, u16);

/// Every kind of answer, for a listed origin, an unlisted one and none:
/// `Vary: Origin` on each, the `Access-Control-*` headers only for the
/// listed one.
#[tokio::test]
async fn every_answer_varies_by_origin_and_only_a_listed_origin_may_read_it() {
    let (_db, _gw, s) = served(true).await;
    let c = Client::new(s.addr);
    let token = hs256(&claims("1", "users:read"));
    let unscoped = hs256(&claims("1", "other"));
    let bearer = format!("Bearer {token}");
    let weak = format!("Bearer {unscoped}");
    let etag = h(&c.get("/users/3", &[]).await, "etag").to_string();
    let cases: Vec<Case> = vec![
        ("a row", Method::GET, "/users/3", vec![], 200),
        ("HEAD", Method::HEAD, "/users/3", vec![], 200),
        (
            "a 304",
            Method::GET,
            "/users/3",
            vec![("if-none-match", etag.as_str())],
            304,
        ),
        (
            "a filtered 404",
            Method::GET,
            "/users/99999999",
            vec![],
            404,
        ),
        ("a malformed key", Method::GET, "/users/abc", vec![], 400),
        ("a 401", Method::GET, "/private/users/3", vec![], 401),
        (
            "a 403",
            Method::GET,
            "/private/users/3",
            vec![("authorization", weak.as_str())],
            403,
        ),
        (
            "a private row",
            Method::GET,
            "/private/users/3",
            vec![("authorization", bearer.as_str())],
            200,
        ),
        ("a 405", Method::DELETE, "/users/3", vec![], 405),
        ("no route", Method::GET, "/nowhere", vec![], 404),
        ("/healthz", Method::GET, "/healthz", vec![], 200),
        ("/readyz", Method::GET, "/readyz", vec![], 200),
        ("/openapi.json", Method::GET, "/openapi.json", vec![], 200),
    ];
    for (what, method, path, headers, status) in &cases {
        for origin in [Some(APP), Some(EVIL), None] {
            let mut all = headers.clone();
            if let Some(o) = origin {
                all.push(("origin", o));
            }
            let r = send(&c, method.clone(), path, &all).await;
            assert_eq!(r.status().as_u16(), *status, "{what} {origin:?}");
            assert!(
                varies(&r).contains(&"origin".to_string()),
                "{what} {origin:?}: {:?}",
                varies(&r)
            );
            match origin {
                Some(APP) => {
                    assert_eq!(h(&r, "access-control-allow-origin"), APP, "{what}");
                    assert!(!h(&r, "access-control-expose-headers").is_empty(), "{what}");
                }
                _ => assert!(
                    cors_headers(&r).is_empty(),
                    "{what} {origin:?}: {:?}",
                    cors_headers(&r)
                ),
            }
        }
    }
    // A row that may come compressed keeps its own Vary, in one line.
    let r = c.get("/users/3", &[("origin", APP)]).await;
    assert_eq!(varies(&r), ["accept-encoding", "origin"]);
    // A rate limit's 429 and its Retry-After are readable too (a burst
    // of 2: four at once, two refused).
    let burst = futures_util::future::join_all(
        (0..4).map(|_| async { c.get("/open/users/3", &[("origin", APP)]).await }),
    )
    .await;
    let refused: Vec<_> = burst.iter().filter(|r| r.status() == 429).collect();
    assert!(!refused.is_empty());
    for r in refused {
        assert_eq!(h(r, "access-control-allow-origin"), APP);
        assert!(h(r, "access-control-expose-headers").contains("Retry-After"));
        assert!(!h(r, "retry-after").is_empty());
    }
    s.shutdown().await.unwrap();
}

/// What an HTTP cache in front does with `Vary` (RFC 9111 §4.1): a stored
/// response is used for a request only if the request's values of the
/// headers its `Vary` names match the request that stored it. The
/// gateway's answers with `Access-Control-Allow-Origin: <app>` must then
/// never be served to another origin's request, nor one without an
/// origin, and the answers without it never to the app's; a cache that
/// ignored `Vary` would (checked too: the model has teeth).
#[tokio::test]
async fn an_http_cache_in_front_keeps_each_origins_answer_apart() {
    struct Stored {
        url: String,
        /// The request's value of each header `Vary` named.
        keyed: Vec<(String, Option<String>)>,
        allow_origin: String,
    }
    /// What a shared cache keyed by URL and `Vary` would serve.
    fn lookup<'s>(
        store: &'s [Stored],
        url: &str,
        req: &[(&str, &str)],
        honour_vary: bool,
    ) -> Option<&'s Stored> {
        store.iter().rev().find(|s| {
            s.url == url
                && (!honour_vary
                    || s.keyed.iter().all(|(name, value)| {
                        let now = req
                            .iter()
                            .find(|(k, _)| k.eq_ignore_ascii_case(name))
                            .map(|(_, v)| v.to_string());
                        now == *value
                    }))
        })
    }
    let (_db, _gw, s) = served(true).await;
    let c = Client::new(s.addr);
    let asks: Vec<Vec<(&str, &str)>> = vec![
        vec![("origin", APP)],
        vec![("origin", EVIL)],
        vec![],
        vec![("origin", APP), ("accept-encoding", "gzip")],
        vec![("origin", EVIL), ("accept-encoding", "gzip")],
    ];
    for path in ["/users/3", "/users/99999999", "/private/users/3"] {
        let url = format!("{}{path}", c.base);
        let mut store: Vec<Stored> = Vec::new();
        let mut ignoring_vary_would_leak = false;
        for ask in asks.iter().chain(asks.iter()) {
            let r = c.get(path, ask).await;
            let origin = ask.iter().find(|(k, _)| *k == "origin").map(|(_, v)| *v);
            let allowed = h(&r, "access-control-allow-origin").to_string();
            assert_eq!(allowed.is_empty(), origin != Some(APP), "{path} {ask:?}");
            // What a cache would answer this request with from its store:
            // only what the gateway answers it (another origin's answer
            // would let that origin's page read it, an answer without the
            // header would fail this origin's page).
            if let Some(hit) = lookup(&store, &url, ask, true) {
                assert_eq!(
                    hit.allow_origin, allowed,
                    "{path}: a response stored for another origin served to {origin:?}"
                );
            }
            if let Some(hit) = lookup(&store, &url, ask, false) {
                ignoring_vary_would_leak |=
                    !hit.allow_origin.is_empty() && Some(hit.allow_origin.as_str()) != origin;
            }
            store.push(Stored {
                url: url.clone(),
                keyed: varies(&r)
                    .into_iter()
                    .map(|name| {
                        let value = ask
                            .iter()
                            .find(|(k, _)| k.eq_ignore_ascii_case(&name))
                            .map(|(_, v)| v.to_string());
                        (name, value)
                    })
                    .collect(),
                allow_origin: allowed,
            });
        }
        assert!(
            ignoring_vary_would_leak,
            "{path}: the model would catch nothing"
        );
    }
    s.shutdown().await.unwrap();
}

/// `OPTIONS *` (a server-wide OPTIONS, never a preflight) stays the 405
/// with `Allow` it is without CORS, with `Vary: Origin` as every answer.
#[tokio::test]
async fn options_star_is_still_405_with_cors_on() {
    let (_db, _gw, s) = served(true).await;
    let mut conn = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    conn.write_all(
        format!(
            "OPTIONS * HTTP/1.1\r\nHost: a\r\nOrigin: {APP}\r\nAccess-Control-Request-Method: GET\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    conn.read_to_string(&mut out).await.unwrap();
    let head = out.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 405"), "{out}");
    assert!(head.contains("\r\nallow: get,head\r\n"), "{out}");
    assert!(head.contains("\r\nvary: origin\r\n"), "{out}");
    assert!(!head.contains("access-control-allow-methods"), "{out}");
    s.shutdown().await.unwrap();
}

/// Off (the default), nothing changes: `OPTIONS` is 405 with `Allow`, no
/// answer says `Vary: Origin` or any `Access-Control-*`, whatever the
/// request's `Origin`.
#[tokio::test]
async fn with_cors_off_an_origin_changes_nothing() {
    let (_db, _gw, s) = served(false).await;
    let c = Client::new(s.addr);
    let pre = send(
        &c,
        Method::OPTIONS,
        "/users/3",
        &[("origin", APP), ("access-control-request-method", "GET")],
    )
    .await;
    assert_eq!(pre.status(), 405);
    assert_eq!(h(&pre, "allow"), "GET,HEAD");
    for path in [
        "/users/3",
        "/users/99999999",
        "/private/users/3",
        "/healthz",
    ] {
        // Cached first, so both answers below are hits.
        c.get(path, &[]).await;
        let with = described(c.get(path, &[("origin", APP)]).await).await;
        let without = described(c.get(path, &[]).await).await;
        assert_eq!(with, without, "{path}");
        assert!(
            with.1
                .iter()
                .all(|(k, v)| !k.starts_with("access-control-") && !v.contains("origin")),
            "{path}: {:?}",
            with.1
        );
    }
    s.shutdown().await.unwrap();
}

/// The public document says who may read it and that answers vary by
/// origin.
#[tokio::test]
async fn the_openapi_document_says_cors_is_on() {
    let (_db, _gw, s) = served(true).await;
    let c = Client::new(s.addr);
    let doc: Value = c.get("/openapi.json", &[]).await.json().await.unwrap();
    let about = doc["info"]["description"].as_str().unwrap();
    assert!(
        about.contains(APP) && about.contains("Vary: Origin"),
        "{about}"
    );
    let vary = &doc["paths"]["/users/{id}"]["get"]["responses"]["200"]["headers"]["Vary"];
    assert!(
        vary["description"].as_str().unwrap().contains("Origin"),
        "{vary}"
    );
    s.shutdown().await.unwrap();
}
