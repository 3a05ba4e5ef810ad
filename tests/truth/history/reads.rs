//! The readers, and the GET they and the driver share.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use bloomgate::http::App;
use serde_json::Value;
use tower::ServiceExt;

use super::{Gw, Shared};
use crate::rng::Rng;

/// What a GET answered.
pub(super) enum Answer {
    Row(Value, String),
    Absent(String),
    /// 503 or 504: not a violation.
    Unavailable,
    Other(StatusCode, String),
}

impl Answer {
    pub(super) fn body(&self) -> Option<&Value> {
        match self {
            Answer::Row(v, _) => Some(v),
            _ => None,
        }
    }

    /// Labelled `detail=stale`: answered during an outage from what was
    /// last vouched for.
    pub(super) fn stale(&self) -> bool {
        match self {
            Answer::Row(_, cs) | Answer::Absent(cs) => cs.contains("detail=stale"),
            _ => false,
        }
    }

    pub(super) fn show(&self) -> String {
        match self {
            Answer::Row(v, cs) => format!("200 {v} [{cs}]"),
            Answer::Absent(cs) => format!("404 [{cs}]"),
            Answer::Unavailable => "503".into(),
            Answer::Other(s, b) => format!("{s} {b}"),
        }
    }
}

/// A GET on `g`: on a gateway with a runtime of its own (the bus feed's
/// fleet), served there, as a process of its own would serve it; one
/// killed meanwhile answers like a process that is gone: unavailable.
pub(super) async fn get(g: &Gw, url: &str) -> Answer {
    match &g.handle {
        None => get_app(&g.app, url).await,
        Some(h) => {
            let (app, url) = (g.app.clone(), url.to_string());
            match h.spawn(async move { get_app(&app, &url).await }).await {
                Ok(answer) => answer,
                // The runtime shut down under it: a gateway killed.
                Err(e) if e.is_cancelled() => Answer::Unavailable,
                // A panic in the request path is a defect, as on every
                // other feed (where the test itself would panic).
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
        }
    }
}

async fn get_app(app: &App, url: &str) -> Answer {
    let req = Request::get(url).body(Body::empty()).unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let cs = resp
        .headers()
        .get("cache-status")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap_or_default();
    match status {
        StatusCode::OK => match serde_json::from_slice(&body) {
            Ok(v) => Answer::Row(v, cs),
            Err(_) => Answer::Other(status, String::from_utf8_lossy(&body).into_owned()),
        },
        StatusCode::NOT_FOUND => Answer::Absent(cs),
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT => Answer::Unavailable,
        _ => Answer::Other(status, String::from_utf8_lossy(&body).into_owned()),
    }
}

/// Ready, and vouched for: `/readyz` 200 with `"status": "ready"` (a
/// degraded gateway also answers 200, under `server.readiness = "local"`,
/// but answers from the database: it is not the one compared).
pub(super) async fn is_ready(g: &Gw) -> bool {
    matches!(get(g, "/readyz").await, Answer::Row(v, _) if v["status"] == "ready")
}

/// Reads random paths from random gateways until told to stop, judging
/// each answer against the versions Postgres committed.
pub(super) async fn reader(shared: Arc<Shared>, mut rng: Rng) {
    while !shared.stop.load(Ordering::Relaxed) {
        let path = {
            let m = shared.model.lock().unwrap();
            m.paths[rng.below(m.paths.len())].clone()
        };
        let live = shared.live();
        if live.is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        let g = live[rng.below(live.len())].clone();
        read_and_judge(&shared, &g, &path).await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// One GET of `path` on `g`, judged against the versions Postgres
/// committed (as a reader judges it).
pub(super) async fn read_and_judge(shared: &Shared, g: &Gw, path: &crate::schema::Path) {
    let url = path.url();
    let t0 = shared.now();
    let answer = get(g, &url).await;
    let t1 = shared.now();
    if g.retired.load(Ordering::SeqCst) {
        return;
    }
    {
        match &answer {
            Answer::Unavailable => {
                shared.unavailable.fetch_add(1, Ordering::Relaxed);
            }
            Answer::Other(..) => {
                shared.violation_once(
                    g.id,
                    &url,
                    format!("gw{} GET {url} -> {}", g.id, answer.show()),
                );
            }
            Answer::Row(..) | Answer::Absent(_) => {
                shared.checks.fetch_add(1, Ordering::Relaxed);
                let verdict =
                    shared
                        .model
                        .lock()
                        .unwrap()
                        .judge(path, answer.body(), t0, t1, answer.stale());
                if let Err(why) = verdict {
                    shared.violation_once(
                        g.id,
                        &url,
                        format!(
                            "during the run: gw{} GET {url} -> {}; {why}",
                            g.id,
                            answer.show()
                        ),
                    );
                }
            }
        }
    }
}
