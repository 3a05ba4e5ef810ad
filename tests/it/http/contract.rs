//! The HTTP contract of a lookup as a client or a downstream cache sees it:
//! `Cache-Control` for every outcome, and HEAD answering exactly GET's
//! headers with no body.

use crate::common;

use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use common::*;

fn req(method: Method, path: &str, etag: Option<&str>) -> Request<Body> {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(tag) = etag {
        b = b.header("if-none-match", tag);
    }
    b.body(Body::empty()).unwrap()
}

/// The headers that describe the response (not the ones that identify
/// this one exchange).
fn described(h: &HeaderMap) -> Vec<(String, String)> {
    let mut v: Vec<_> = h
        .iter()
        .filter(|(n, _)| !matches!(n.as_str(), "x-request-id" | "date"))
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string()))
        .collect();
    v.sort();
    v
}

/// Every outcome of a lookup, as (what, GET path, If-None-Match, status,
/// Cache-Status, Cache-Control). Each GET is preceded by a HEAD of an
/// equivalent request in the same state (a cold key for a cold key, the
/// same key once it is cached), so both must describe the same response.
#[tokio::test]
async fn cache_control_and_head_for_every_outcome() {
    let db = TestDb::new().await;
    db.seed_users(20).await;
    let proxy = Proxy::start().await;
    let cfg = config(
        &proxy.url(&db),
        r#"
        [cache]
        http_cache_control = "max-age=5, stale-while-revalidate=10, stale-if-error=60"
        http_cache_control_not_found = "max-age=2"
        negative_ttl = "3s"
        "#,
    );
    let gw = started(cfg).await;
    let row_cc = "max-age=5, stale-while-revalidate=10, stale-if-error=60";

    // Cold rows: HEAD of one, GET of another, both loaded now.
    let head = get_with(&gw, req(Method::HEAD, "/users/1", None)).await;
    let got = get_with(&gw, req(Method::GET, "/users/2", None)).await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.header("cache-status"), "bloomgate; fwd=miss; stored");
    assert_eq!(got.header("cache-control"), row_cc);
    assert!(head.body.is_empty());
    let strip_etag = |h: &HeaderMap| {
        described(h)
            .into_iter()
            .filter(|(n, _)| n != "etag")
            .collect::<Vec<_>>()
    };
    assert_eq!(strip_etag(&head.headers), strip_etag(&got.headers));
    assert!(!got.body.is_empty());

    // Cached rows: same key, HEAD then GET.
    let head = get_with(&gw, req(Method::HEAD, "/users/2", None)).await;
    let got = get_with(&gw, req(Method::GET, "/users/2", None)).await;
    assert_eq!(got.header("cache-status"), "bloomgate; hit");
    assert_eq!(described(&head.headers), described(&got.headers));
    assert!(head.body.is_empty());

    // Revalidation: the 304 carries the row's Cache-Control and ETag.
    let etag = got.header("etag").to_string();
    let head = get_with(&gw, req(Method::HEAD, "/users/2", Some(&etag))).await;
    let got = get_with(&gw, req(Method::GET, "/users/2", Some(&etag))).await;
    assert_eq!(got.status, StatusCode::NOT_MODIFIED);
    assert_eq!(got.header("cache-control"), row_cc);
    assert_eq!(got.header("etag"), etag);
    assert_eq!(described(&head.headers), described(&got.headers));

    // Malformed key, and a key the filter rejects.
    for (path, status, cc) in [
        ("/users/abc", StatusCode::BAD_REQUEST, "no-store"),
        ("/users/999999", StatusCode::NOT_FOUND, "max-age=2"),
    ] {
        let head = get_with(&gw, req(Method::HEAD, path, None)).await;
        let got = get_with(&gw, req(Method::GET, path, None)).await;
        assert_eq!((got.status, got.header("cache-control")), (status, cc));
        assert_eq!(head.status, status);
        assert_eq!(described(&head.headers), described(&got.headers));
        assert!(head.body.is_empty() && !got.body.is_empty());
    }

    // A negative entry: a row deleted behind the gateway's back (no feed
    // here) passes the filter and is found absent.
    db.exec("ALTER TABLE users DISABLE TRIGGER USER; DELETE FROM users WHERE id IN (7, 8)")
        .await;
    let head = get_with(&gw, req(Method::HEAD, "/users/7", None)).await;
    let got = get_with(&gw, req(Method::GET, "/users/8", None)).await;
    assert_eq!(got.status, StatusCode::NOT_FOUND);
    assert_eq!(
        got.header("cache-status"),
        "bloomgate; fwd=miss; stored; detail=negative"
    );
    assert_eq!(got.header("cache-control"), "max-age=2");
    assert_eq!(described(&head.headers), described(&got.headers));
    let got = get_with(&gw, req(Method::GET, "/users/7", None)).await;
    assert_eq!(
        got.header("cache-status"),
        "bloomgate; hit; detail=negative"
    );
    assert_eq!(got.header("cache-control"), "max-age=2");

    // An outage: cold keys are 503, never to be stored downstream.
    proxy.cut();
    let head = get_with(&gw, req(Method::HEAD, "/users/11", None)).await;
    let got = get_with(&gw, req(Method::GET, "/users/12", None)).await;
    assert_eq!(got.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(got.header("cache-control"), "no-store");
    assert_eq!(got.header("retry-after"), "1");
    assert_eq!(described(&head.headers), described(&got.headers));
    assert!(head.body.is_empty());
    proxy.restore();
}

#[tokio::test]
async fn the_shipped_default_makes_downstream_caches_revalidate() {
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let gw = started(config(&db.url, "")).await;
    let got = get(&gw, "/users/1").await;
    assert_eq!(got.header("cache-control"), "max-age=0, stale-if-error=300");
    let got = get(&gw, "/users/999").await;
    assert_eq!(got.header("cache-control"), "no-cache");
}

#[test]
fn cache_control_values_are_checked_at_start_up() {
    let bad = [
        (
            "http_cache_control = \"max-age=ten\"",
            "cache.http_cache_control",
        ),
        ("http_cache_control = \"\"", "cache.http_cache_control"),
        (
            "http_cache_control = \"max-age=5, bogus\"",
            "cache.http_cache_control",
        ),
        (
            "http_cache_control_not_found = \"max-age=60\"",
            "cache.http_cache_control_not_found",
        ),
    ];
    for (line, key) in bad {
        let text = format!(
            "[database]\nurl = \"postgres://x@127.0.0.1/x\"\n[cache]\n{line}\n\
             [[resource]]\nname = \"users\"\nroute = \"/users/{{id}}\"\ntable = \"users\"\n\
             key_column = \"id\"\nkey_type = \"bigint\"\ncolumns = [\"id\"]\n"
        );
        let err = bloomgate::config::Config::from_toml(&text)
            .expect_err(line)
            .to_string();
        assert!(err.contains(key), "{line}: {err}");
    }
    // A resource's own value is checked under its own name.
    let text = "[database]\nurl = \"postgres://x@127.0.0.1/x\"\n\
        [[resource]]\nname = \"users\"\nroute = \"/users/{id}\"\ntable = \"users\"\n\
        key_column = \"id\"\nkey_type = \"bigint\"\ncolumns = [\"id\"]\n\
        [resource.cache]\nhttp_cache_control = \"max-age=-1\"\n";
    let err = bloomgate::config::Config::from_toml(text)
        .expect_err("negative max-age")
        .to_string();
    assert!(err.contains("http_cache_control"), "{err}");
}

/// An 8 kB article body, served from the cache in each coding the client
/// prefers: compressed once, each with its own ETag, `If-None-Match`
/// working for each, `Vary: Accept-Encoding` on every row response.
#[tokio::test]
async fn rows_are_served_in_the_coding_the_client_prefers() {
    use std::io::Read;
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let id = "0b1e5c55-0000-4000-8000-000000000001";
    db.exec(&format!(
        "INSERT INTO articles (id, title, body) \
         VALUES ('{id}', 'long', repeat('the quick brown fox jumps over the lazy dog ', 190))"
    ))
    .await;
    let extra = r#"
        [[resource]]
        name = "bodies"
        route = "/bodies/{id}"
        table = "articles"
        key_column = "id"
        key_type = "uuid"
        columns = ["id", "title", "body"]
    "#;
    let gw = started(config(&db.url, extra)).await;
    let path = format!("/bodies/{id}");
    let with = |ae: Option<&str>, inm: Option<&str>| {
        let mut b = Request::get(&path);
        if let Some(ae) = ae {
            b = b.header("accept-encoding", ae);
        }
        if let Some(tag) = inm {
            b = b.header("if-none-match", tag);
        }
        b.body(Body::empty()).unwrap()
    };
    let plain = get_with(&gw, with(None, None)).await;
    assert_eq!(plain.status, StatusCode::OK);
    assert!(plain.body.len() > 8000, "{}", plain.body.len());
    assert_eq!(plain.header("content-encoding"), "");
    assert_eq!(plain.header("vary"), "accept-encoding");
    let decode = |coding: &str, body: &[u8]| -> Vec<u8> {
        let mut out = Vec::new();
        match coding {
            "gzip" => {
                flate2::read::GzDecoder::new(body)
                    .read_to_end(&mut out)
                    .unwrap();
            }
            "br" => brotli::BrotliDecompress(&mut &body[..], &mut out).unwrap(),
            "zstd" => out = zstd::decode_all(body).unwrap(),
            c => panic!("{c}"),
        }
        out
    };
    let mut tags = vec![plain.header("etag").to_string()];
    for (ae, coding) in [
        ("gzip", "gzip"),
        ("br", "br"),
        ("zstd", "zstd"),
        ("gzip;q=0.5, zstd;q=0.8, br;q=0.1", "zstd"),
        ("br, gzip, zstd", "br"),
    ] {
        let r = get_with(&gw, with(Some(ae), None)).await;
        assert_eq!(r.header("cache-status"), "bloomgate; hit", "{ae}");
        assert_eq!(r.header("content-encoding"), coding, "{ae}");
        assert_eq!(r.header("vary"), "accept-encoding");
        assert!(
            r.body.len() * 4 < plain.body.len(),
            "{ae}: {}",
            r.body.len()
        );
        assert_eq!(decode(coding, &r.body), plain.body, "{ae}");
        let tag = r.header("etag").to_string();
        assert!(tag.ends_with(&format!("-{coding}\"")), "{tag}");
        // The 304 is per representation.
        let r304 = get_with(&gw, with(Some(ae), Some(&tag))).await;
        assert_eq!(r304.status, StatusCode::NOT_MODIFIED, "{ae}");
        assert_eq!(r304.header("etag"), tag);
        assert_eq!(r304.header("vary"), "accept-encoding");
        assert_eq!(
            r304.header("content-encoding"),
            "",
            "a 304 has no body to encode"
        );
        let other = get_with(&gw, with(None, Some(&tag))).await;
        assert_eq!(
            other.status,
            StatusCode::OK,
            "identity must not match {tag}"
        );
        tags.push(tag);
    }
    tags.sort();
    tags.dedup();
    assert_eq!(tags.len(), 4, "{tags:?}");
    // identity refused with nothing else on offer: identity anyway.
    let r = get_with(&gw, with(Some("identity;q=0"), None)).await;
    assert_eq!(
        (r.status, r.header("content-encoding")),
        (StatusCode::OK, "")
    );
    // A small row has one representation, but says it could vary.
    let r = get_with(
        &gw,
        Request::get("/users/1")
            .header("accept-encoding", "br")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.header("content-encoding"), "");
    assert_eq!(r.header("vary"), "accept-encoding");
    // Compression off: no variants, no Vary.
    let gw = started(config(
        &db.url,
        &format!("{extra}\n[cache]\ncompression = false\n"),
    ))
    .await;
    let r = get_with(&gw, with(Some("br"), None)).await;
    assert_eq!(r.header("content-encoding"), "");
    assert_eq!(r.header("vary"), "");
}

/// A resource routed at `/{id}`: a GET of the router's own paths fits its
/// template too, so `http::dispatch` must leave those to the router (which
/// prefers the fixed path), while a key still reaches the resource.
#[tokio::test]
async fn a_resource_at_the_root_leaves_the_routers_own_paths_alone() {
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let mut cfg = config(&db.url, "");
    cfg.resources[0].route = "/{id}".into();
    let gw = started(cfg).await;
    assert_eq!(get(&gw, "/healthz").await.json()["status"], "ok");
    assert_eq!(get(&gw, "/readyz").await.json()["status"], "ready");
    let doc = get(&gw, "/openapi.json").await;
    assert_eq!(doc.status, StatusCode::OK);
    assert!(doc.json()["paths"]["/{id}"].is_object(), "{}", doc.json());
    assert_eq!(get(&gw, "/2").await.json()["id"], 2);
    let absent = get(&gw, "/999").await;
    assert_eq!(absent.status, StatusCode::NOT_FOUND);
    assert_eq!(
        absent.header("cache-status"),
        "bloomgate; detail=filter-absent"
    );
}

/// RFC 9110 §13.1.1: `If-Match` on a row: a strong match (or `*`, the row
/// exists) answers as without it; anything else is 412 with the current
/// ETag, never the row. A 404 ignores it (§13.2.1: preconditions apply only
/// to what would be a 2xx).
#[tokio::test]
async fn if_match_answers_412_unless_it_matches() {
    let db = TestDb::new().await;
    db.seed_users(5).await;
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    let with = |tag: &str| {
        Request::get("/users/1")
            .header("if-match", tag)
            .body(Body::empty())
            .unwrap()
    };
    let r = get(&gw, "/users/1").await;
    let etag = r.header("etag").to_string();
    for tag in [etag.as_str(), "*", &format!("\"nope\", {etag}")] {
        let r = get_with(&gw, with(tag)).await;
        assert_eq!(r.status, StatusCode::OK, "If-Match: {tag}");
    }
    for tag in ["\"nope\"", &format!("W/{etag}")] {
        let r = get_with(&gw, with(tag)).await;
        assert_eq!(r.status, StatusCode::PRECONDITION_FAILED, "If-Match: {tag}");
        assert_eq!(r.header("etag"), etag);
        assert_eq!(r.json()["error"], "precondition_failed");
        assert_eq!(r.header("cache-control"), "no-store");
    }
    let head = get_with(
        &gw,
        Request::head("/users/1")
            .header("if-match", "\"nope\"")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(head.status, StatusCode::PRECONDITION_FAILED);
    assert!(head.body.is_empty());
    let r = get_with(
        &gw,
        Request::get("/users/999")
            .header("if-match", "*")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}
