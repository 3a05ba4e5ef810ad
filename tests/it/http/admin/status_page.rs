//! The status page in a real browser: headless Chromium loads `/admin/`
//! from a running gateway, signs in with the token through the page's own
//! login form, and must show a card per resource with live numbers. A
//! screenshot is kept in `target/test-artifacts/status-page.png`.
//!
//! Needs Chromium (`scripts/test.sh` installs Debian's `chromium` when it is
//! missing); `BLOOMGATE_CHROMIUM` names another binary.

use crate::common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use bloomgate::server::Admin;
use common::*;

const TOKEN: &str = "status-page-token-0123456789";

fn chromium() -> PathBuf {
    if let Ok(p) = std::env::var("BLOOMGATE_CHROMIUM") {
        return p.into();
    }
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::var("PATH").unwrap_or_default().split(':') {
            let p = PathBuf::from(dir).join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "no Chromium found: install Debian's `chromium` (scripts/test.sh does) or set BLOOMGATE_CHROMIUM"
    );
}

async fn run_chromium(extra: &[&str], url: &str) -> String {
    let profile =
        std::env::temp_dir().join(format!("bloomgate-chromium-{:x}", rand::random::<u64>()));
    let mut cmd = tokio::process::Command::new(chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--virtual-time-budget=6000",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(extra)
    .arg(url)
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("chromium did not finish within 60 s")
        .expect("cannot run chromium");
    let _ = std::fs::remove_dir_all(&profile);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The text of `<dd data-field="{field}">` inside the card of `resource`.
fn field(dom: &str, resource: &str, field: &str) -> Option<String> {
    let card = dom.split(&format!("data-resource=\"{resource}\"")).nth(1)?;
    let card = card.split("</section>").next()?;
    let at = card.split(&format!("data-field=\"{field}\">")).nth(1)?;
    Some(at.split('<').next()?.to_string())
}

#[tokio::test]
async fn the_status_page_shows_a_card_per_resource() {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    let gw = gateway(config(&db.url, "freshness = \"off\""));
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin_addr = admin.local_addr().unwrap();
    let admin = Admin {
        listener: admin,
        token: TOKEN.into(),
    };
    let served = serve_socket(&gw, Some(admin)).await;
    let public_addr = served.addr;
    let client = reqwest::Client::new();
    for path in ["/users/1", "/users/1", "/users/5000", "/users/x"] {
        client
            .get(format!("http://{public_addr}{path}"))
            .send()
            .await
            .unwrap();
    }

    // A refused rebuild (65 % deleted) that still finds two rows inserted
    // behind the gateway's back: both added to the live filter.
    db.exec("DELETE FROM users WHERE id > 35").await;
    db.exec("INSERT INTO users (id, email, name) VALUES (5000, 'a@x', 'A'), (5001, 'b@x', 'B')")
        .await;
    let r = client
        .post(format!(
            "http://{admin_addr}/admin/resources/users/rebuild?wait=true"
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);

    let url = format!("http://{admin_addr}/admin/#token={TOKEN}");
    let dom = run_chromium(&["--dump-dom"], &url).await;
    assert!(
        dom.contains("data-resource=\"users\""),
        "no users card:\n{dom}"
    );
    assert!(
        dom.contains("data-resource=\"articles\""),
        "no articles card"
    );
    // The change feed in force (the server on :5432 has wal_level =
    // replica, so auto takes notify).
    assert!(dom.contains("change feed: notify"), "no change feed mode");
    assert_eq!(
        field(&dom, "users", "keys").as_deref(),
        Some("102"),
        "{dom}"
    );
    let filter = field(&dom, "users", "filter").unwrap();
    assert!(filter.starts_with("exact,"), "{filter}");
    let requests = field(&dom, "users", "requests").unwrap();
    assert!(requests.starts_with("4 (1 filtered)"), "{requests}");
    assert!(
        field(&dom, "users", "last rebuild")
            .unwrap()
            .contains("gen 1")
    );
    let refusal = field(&dom, "users", "last refused").unwrap();
    assert!(
        refusal.ends_with(": found 37 of 100 keys; 2 missing keys added"),
        "{refusal}"
    );
    assert_eq!(
        field(&dom, "users", "rebuilds").as_deref(),
        Some("1 ok, 0 failed (0 retried), 1 refused, 0 for decay")
    );
    assert_eq!(
        field(&dom, "users", "rebuild now").as_deref(),
        Some("idle; last refused")
    );
    assert_eq!(
        field(&dom, "users", "estimated FP").as_deref(),
        Some("0 % (exact set)")
    );
    assert_eq!(
        field(&dom, "users", "since build").as_deref(),
        Some("+2 inserts, −0 deletes (rebuild at +1024 / −25)")
    );
    // The uuid resource is a Bloom filter even empty: the model's estimate,
    // the target and the rebuild threshold.
    assert_eq!(
        field(&dom, "articles", "estimated FP").as_deref(),
        Some("0.000 % (target 1.00 %; rebuild above 2.00 %)")
    );
    assert_eq!(
        field(&dom, "users", "observed FP").as_deref(),
        Some("0.000 % (0)")
    );
    // Who may read it, and the refusals (none for a public resource).
    assert_eq!(field(&dom, "users", "access").as_deref(), Some("none"));
    assert_eq!(
        field(&dom, "users", "refused").as_deref(),
        Some("401: 0, 403: 0, 429: 0")
    );
    let refused = "id=\"login-error\">That token was refused.</div>";
    assert!(!dom.contains(refused));

    // A wrong token is refused by the page.
    let wrong = run_chromium(
        &["--dump-dom"],
        &format!("http://{admin_addr}/admin/#token=wrong-token-wrong-token"),
    )
    .await;
    assert!(wrong.contains(refused), "{wrong}");
    assert!(!wrong.contains("<section class=\"card\""));

    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("../test-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    let shot = dir.join("status-page.png");
    let _ = std::fs::remove_file(&shot);
    run_chromium(
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1280,1000",
        ],
        &url,
    )
    .await;
    let png = std::fs::read(&shot).expect("no screenshot written");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );

    served.shutdown().await.unwrap();
}
