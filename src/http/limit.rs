//! `BodyLimitLayer`: refuses a request that declares a body over the limit
//! with 413, before any other work. Bodies are never read (every route is a
//! GET), so a smaller one is simply ignored. A plain tower layer rather than
//! `middleware::from_fn`, which boxes a future for every request.

use std::future::{Ready, ready};
use std::task::{Context, Poll};

use axum::http::{Request, StatusCode, header};
use axum::response::Response;
use futures_util::future::Either;
use tower::{Layer, Service};

use super::response::json_error;

#[derive(Clone, Copy, Debug)]
pub struct BodyLimitLayer {
    pub max: u64,
}

impl<S> Layer<S> for BodyLimitLayer {
    type Service = BodyLimit<S>;

    fn layer(&self, inner: S) -> BodyLimit<S> {
        BodyLimit {
            inner,
            max: self.max,
        }
    }
}

#[derive(Clone, Debug)]
pub struct BodyLimit<S> {
    inner: S,
    max: u64,
}

impl<S, B> Service<Request<B>> for BodyLimit<S>
where
    S: Service<Request<B>, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Either<Ready<Result<Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        match declared {
            Some(n) if n > self.max => Either::Left(ready(Ok(json_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                &format!("request bodies are limited to {} bytes", self.max),
            )))),
            _ => Either::Right(self.inner.call(req)),
        }
    }
}
