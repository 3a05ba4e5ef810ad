//! The HTTP answers, byte for byte: a fixed set of requests, every outcome
//! a lookup can have (hit, miss, filtered, negative, malformed, 304, 412,
//! each coding, HEAD, 401, 403, the router's own paths), against a
//! deterministic database, compared with `tests/data/golden/responses.txt`.
//!
//! It exists so that code can be reshaped with proof that nothing a client
//! sees changed. A change that means to change an answer rewrites the file
//! (`BLOOMGATE_GOLDEN=write cargo test --test it -- http::golden::`) and the diff shows
//! exactly what changed. Headers that differ per exchange (`date`,
//! `x-request-id`) are left out; a body that is not text is recorded by its
//! length and an FNV-1a hash.

use crate::common;

use std::fmt::Write as _;

use axum::body::Body;
use axum::http::Request;
use common::*;

const GOLDEN: &str = "tests/data/golden/responses.txt";

/// A signing secret and a token for it that expires in 2100: the token, and
/// so the answers, are the same on every run.
const SECRET: &str = "golden-secret-golden-secret-golden-secret";
const TOKEN_EXP: u64 = 4_102_444_800;

fn token(sub: &str, scope: &str) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64.encode(br#"{"alg":"HS256","typ":"JWT"}"#);
    let claims =
        b64.encode(format!(r#"{{"sub":"{sub}","scope":"{scope}","exp":{TOKEN_EXP}}}"#).as_bytes());
    let input = format!("{header}.{claims}");
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, SECRET.as_bytes());
    let sig = b64.encode(ring::hmac::sign(&key, input.as_bytes()).as_ref());
    format!("{input}.{sig}")
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// One exchange as text: the request, the status, the headers that
/// describe the response, sorted, and the body.
fn describe(label: &str, r: &Resp) -> String {
    let mut out = format!("### {label}\n{}\n", r.status.as_u16());
    let mut headers: Vec<(String, String)> = r
        .headers
        .iter()
        .filter(|(n, _)| !matches!(n.as_str(), "date" | "x-request-id"))
        .map(|(n, v)| {
            (
                n.to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    headers.sort();
    for (n, v) in headers {
        let _ = writeln!(out, "{n}: {v}");
    }
    match std::str::from_utf8(&r.body) {
        Ok(text) if !text.contains('\0') => {
            let _ = writeln!(out, "\n{text}");
        }
        _ => {
            let _ = writeln!(
                out,
                "\n<{} bytes, fnv1a {:016x}>",
                r.body.len(),
                fnv1a(&r.body)
            );
        }
    }
    out
}

#[tokio::test]
async fn every_outcome_answers_as_recorded() {
    let db = TestDb::new().await;
    db.seed_users(20).await;
    // A row whose label is long enough to be stored compressed, one short.
    db.exec(
        "CREATE TABLE things (code text PRIMARY KEY, label text NOT NULL);
         INSERT INTO things VALUES ('long', repeat('the quick brown fox jumps over the lazy dog; ', 60)),
                                   ('short', 'S');
         INSERT INTO articles (id, author_id, title, body)
              VALUES ('00000000-0000-0000-0000-000000000001', 1, 'First', 'Body')",
    )
    .await;
    let extra = format!(
        r#"freshness = "off"
        [auth]
        jwt_secret = "{SECRET}"
        {THINGS}
        [[resource]]
        name = "me"
        route = "/me/{{id}}"
        table = "users"
        key_column = "id"
        key_type = "bigint"
        columns = ["id", "email", "name"]
        auth = "jwt"
        scopes = ["profile"]
        owner_claim = "sub"
        "#
    );
    let gw = started(config(&db.url, &extra)).await;
    // A key the filter passes whose row is gone: a negative entry.
    db.exec("DELETE FROM users WHERE id = 20").await;

    let me = token("3", "profile");
    let no_scope = token("3", "other");
    let req = |method: &str, path: &str, headers: &[(&str, &str)]| {
        let mut b = Request::builder().method(method).uri(path);
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(Body::empty()).unwrap()
    };
    let cases: Vec<(String, Request<Body>)> = vec![
        ("GET /users/7 (miss)".into(), req("GET", "/users/7", &[])),
        ("GET /users/7 (hit)".into(), req("GET", "/users/7", &[])),
        ("HEAD /users/7".into(), req("HEAD", "/users/7", &[])),
        (
            "GET /users/999 (filtered)".into(),
            req("GET", "/users/999", &[]),
        ),
        ("HEAD /users/999".into(), req("HEAD", "/users/999", &[])),
        (
            "GET /users/20 (negative, stored)".into(),
            req("GET", "/users/20", &[]),
        ),
        (
            "GET /users/20 (negative hit)".into(),
            req("GET", "/users/20", &[]),
        ),
        (
            "GET /users/abc (malformed)".into(),
            req("GET", "/users/abc", &[]),
        ),
        (
            "GET /users/%ZZ (bad percent)".into(),
            req("GET", "/users/%ZZ", &[]),
        ),
        (
            "GET /users/7 If-None-Match".into(),
            req(
                "GET",
                "/users/7",
                &[("if-none-match", "\"5ed24e60a20214ae\"")],
            ),
        ),
        (
            "GET /users/7 If-Match (mismatch)".into(),
            req("GET", "/users/7", &[("if-match", "\"nope\"")]),
        ),
        ("POST /users/7".into(), req("POST", "/users/7", &[])),
        (
            "GET /articles/…0001".into(),
            req("GET", "/articles/00000000-0000-0000-0000-000000000001", &[]),
        ),
        (
            "GET /articles/nope".into(),
            req("GET", "/articles/nope", &[]),
        ),
        ("GET /things/short".into(), req("GET", "/things/short", &[])),
        (
            "GET /things/long identity".into(),
            req("GET", "/things/long", &[("accept-encoding", "identity")]),
        ),
        (
            "GET /things/long gzip".into(),
            req("GET", "/things/long", &[("accept-encoding", "gzip")]),
        ),
        (
            "GET /things/long br".into(),
            req("GET", "/things/long", &[("accept-encoding", "br")]),
        ),
        (
            "GET /things/long zstd".into(),
            req("GET", "/things/long", &[("accept-encoding", "zstd")]),
        ),
        (
            "GET /things/long any".into(),
            req(
                "GET",
                "/things/long",
                &[("accept-encoding", "gzip, br, zstd")],
            ),
        ),
        ("GET /me/3 (no token)".into(), req("GET", "/me/3", &[])),
        (
            "GET /me/3 (bad token)".into(),
            req("GET", "/me/3", &[("authorization", "Bearer not.a.token")]),
        ),
        (
            "GET /me/3 (no scope)".into(),
            req(
                "GET",
                "/me/3",
                &[("authorization", &format!("Bearer {no_scope}"))],
            ),
        ),
        (
            "GET /me/3".into(),
            req(
                "GET",
                "/me/3",
                &[("authorization", &format!("Bearer {me}"))],
            ),
        ),
        (
            "GET /me/4 (another owner)".into(),
            req(
                "GET",
                "/me/4",
                &[("authorization", &format!("Bearer {me}"))],
            ),
        ),
        ("GET /healthz".into(), req("GET", "/healthz", &[])),
        ("GET /readyz".into(), req("GET", "/readyz", &[])),
        ("GET /nowhere".into(), req("GET", "/nowhere", &[])),
    ];
    let mut recorded = String::new();
    for (label, request) in cases {
        let r = get_with(&gw, request).await;
        recorded.push_str(&describe(&label, &r));
        recorded.push('\n');
    }
    gw.stop();
    if std::env::var("BLOOMGATE_GOLDEN").is_ok_and(|v| v == "write") {
        std::fs::create_dir_all("tests/data/golden").unwrap();
        std::fs::write(GOLDEN, &recorded).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(GOLDEN).expect(
        "no recorded answers: BLOOMGATE_GOLDEN=write cargo test --test it -- http::golden::",
    );
    if recorded != expected {
        let first = recorded
            .lines()
            .zip(expected.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        panic!(
            "the answers changed from line {} (recorded vs {GOLDEN}):\n{}\n---\n{}",
            first + 1,
            recorded
                .lines()
                .skip(first)
                .take(8)
                .collect::<Vec<_>>()
                .join("\n"),
            expected
                .lines()
                .skip(first)
                .take(8)
                .collect::<Vec<_>>()
                .join("\n"),
        );
    }
}
