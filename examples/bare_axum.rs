//! The ceiling for `bench/run.sh`: the smallest axum server that answers
//! `GET /users/{id}` with a fixed JSON body the size of a typical seeded
//! users row as the gateway serves it (108 bytes, user 500000), under the same
//! runtime as `bloomgate serve` (`#[tokio::main]`, multi-threaded, one worker
//! per core). No database, no cache, no middleware: whatever the gateway
//! measures below this is the cost of everything it does on top of axum.
//!
//!     cargo run --release --example bare_axum -- --listen 127.0.0.1:18081

use std::net::SocketAddr;

use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use clap::Parser;

/// What `/users/500000` returns from the gateway on the seeded demo data.
pub const BODY: &[u8] =
    br#"{"id":500000,"name":"User 500000","created_at":"2024-12-13T05:20:00+00:00"}"#;

#[derive(Parser)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:18081")]
    listen: SocketAddr,
}

pub async fn user() -> Response {
    let mut resp = (StatusCode::OK, Bytes::from_static(BODY)).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    eprintln!(
        "bare_axum listening on {} ({} byte body)",
        args.listen,
        BODY.len()
    );
    axum::serve(listener, app()).await
}

/// The routes (examples/hit_cost.rs measures them without a server).
pub fn app() -> Router {
    Router::new()
        .route("/users/{id}", get(user))
        .route("/readyz", get(|| async { "ready" }))
}
