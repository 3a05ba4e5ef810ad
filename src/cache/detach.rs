//! [`DetachOnDrop`]: a future that, dropped before it completes, is
//! spawned to finish on the current runtime instead of being cancelled.
//! What makes a row load outlive the request that started it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

/// A future that, if dropped before it completes, is spawned onto the
/// current runtime to finish there instead of being cancelled.
pub struct DetachOnDrop<F: Future<Output = T> + Send + 'static, T: Send + 'static> {
    fut: Option<Pin<Box<F>>>,
}

impl<F: Future<Output = T> + Send + 'static, T: Send + 'static> DetachOnDrop<F, T> {
    pub fn new(fut: F) -> Self {
        Self {
            fut: Some(Box::pin(fut)),
        }
    }
}

impl<F: Future<Output = T> + Send + 'static, T: Send + 'static> Future for DetachOnDrop<F, T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let fut = self.fut.as_mut().expect("polled after completion");
        let out = ready!(fut.as_mut().poll(cx));
        self.fut = None;
        Poll::Ready(out)
    }
}

impl<F: Future<Output = T> + Send + 'static, T: Send + 'static> Drop for DetachOnDrop<F, T> {
    fn drop(&mut self) {
        if let Some(fut) = self.fut.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(async move {
                fut.await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::*;

    /// Dropped mid-way, the future still runs to its end; awaited, it
    /// answers as the future itself would.
    #[tokio::test]
    async fn a_dropped_future_finishes_on_the_runtime() {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let fut = DetachOnDrop::new(async move {
            let _ = started_tx.send(());
            tokio::time::sleep(Duration::from_millis(20)).await;
            d.store(true, Ordering::SeqCst);
        });
        let waiting = tokio::spawn(fut);
        started.await.unwrap();
        waiting.abort();
        let _ = waiting.await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(done.load(Ordering::SeqCst), "cancelled with its caller");
        assert_eq!(DetachOnDrop::new(async { 7 }).await, 7);
    }
}
