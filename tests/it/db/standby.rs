//! Issue 10, suspicion: pointed at a hot standby, start-up hung forever
//! (`LISTEN` is refused during recovery and the listener retried without
//! end). It must fail fast with an error naming the cause.
//!
//! The standby comes from `scripts/standby.sh` (a cluster in permanent
//! recovery on port 54334, no primary needed), started here if it is not
//! running.

use crate::common;

use std::time::Duration;

use bloomgate::feed::{Watch, notify};
use common::*;

/// Started once per test binary (the tests run in parallel).
fn standby_url() -> String {
    static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    URL.get_or_init(start_standby).clone()
}

fn start_standby() -> String {
    let out = std::process::Command::new("scripts/standby.sh")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("scripts/standby.sh runs");
    assert!(
        out.status.success(),
        "scripts/standby.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let base = String::from_utf8(out.stdout).unwrap();
    format!("{}/postgres", base.trim())
}

#[tokio::test]
async fn start_up_against_a_hot_standby_fails_fast_naming_the_cause() {
    let url = standby_url();
    let gw = gateway(config(&url, ""));
    let err = tokio::time::timeout(Duration::from_secs(20), gw.start())
        .await
        .expect("start-up against a standby hangs")
        .unwrap_err()
        .to_string();
    gw.stop();
    assert!(
        err.contains("hot standby") && err.contains("pg_is_in_recovery()"),
        "{err}"
    );
    // Without the change feed a standby is fine to read from (the schema
    // check is what fails here: this standby has no tables).
    let gw = gateway(config(&url, "freshness = \"off\""));
    let err = tokio::time::timeout(Duration::from_secs(20), gw.start())
        .await
        .expect("start-up against a standby hangs")
        .unwrap_err()
        .to_string();
    gw.stop();
    assert!(!err.contains("standby"), "{err}");
}

/// The source itself refuses too (the gateway checks first; a source used
/// on its own must not hang either).
#[tokio::test]
async fn the_notify_source_refuses_a_standby() {
    let url = standby_url();
    let connect: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let (tx, _rx) = tokio::sync::mpsc::channel(1);
    let (ready_tx, ready) = tokio::sync::oneshot::channel();
    let opts = notify::NotifyOptions {
        connect,
        counters: Default::default(),
        health: Default::default(),
        install: false,
        identity: Default::default(),
    };
    let task = tokio::spawn(notify::run(
        opts,
        Watch::default(),
        tx,
        ready_tx,
        bloomgate::shutdown::Shutdown::never(),
    ));
    let r = tokio::time::timeout(Duration::from_secs(20), ready)
        .await
        .expect("the source hangs on a standby")
        .unwrap();
    let err = r.unwrap_err();
    assert!(
        matches!(
            err,
            bloomgate::feed::NotStarted::Notify(notify::NotifyError::Standby)
        ),
        "{err}"
    );
    assert!(err.to_string().contains("pg_is_in_recovery()"), "{err}");
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the source ends")
        .unwrap();
}
