//! The shutdown signal every long-lived task is given, as mini-redis passes
//! one: a task waits for its work *or* the signal, and on the signal
//! finishes the unit of work it is in (an event applied, a batch
//! confirmed), closes what it holds and returns.
//!
//! `abort()` stays the last resort of a deadline (`Gateway::shutdown`), and
//! drop guards the second line of defence: a task aborted mid-scan still
//! cancels its query and closes its journal.
//!
//! # Guarantees (tested below)
//! - Every signal made from one trigger sees it fire, whenever it was made,
//!   before or after.
//! - [`Shutdown::fired`] resolves at once on a signal that has fired, and is
//!   cancel-safe (it can be a `select!` branch on every turn of a loop).
//! - [`Shutdown::never`] never fires.
//! - A [`FiresOnDrop`] fires when it is dropped, if it has not already: the
//!   tasks of an owner that may be dropped without a clean stop (a server
//!   future cancelled, a gateway's key set dropped with it) stop as if
//!   told. A plain [`Trigger`] dropped unfired is no shutdown.

use tokio::sync::watch;

/// What fires the shutdown.
#[derive(Debug)]
pub struct Trigger(watch::Sender<bool>);

/// What a task holds to learn of the shutdown; clone it for each task.
#[derive(Clone, Debug)]
pub struct Shutdown(Option<watch::Receiver<bool>>);

/// A trigger and the first signal made from it.
pub fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Trigger(tx), Shutdown(Some(rx)))
}

impl Trigger {
    /// Fires: every signal made from this trigger sees it, now and later.
    pub fn fire(&self) {
        self.0.send_replace(true);
    }

    /// Another signal, for another task.
    pub fn signal(&self) -> Shutdown {
        Shutdown(Some(self.0.subscribe()))
    }
}

/// A [`Trigger`] that also fires when dropped (see the guarantees).
#[derive(Debug)]
pub struct FiresOnDrop(Trigger);

impl FiresOnDrop {
    pub fn new() -> Self {
        FiresOnDrop(channel().0)
    }

    pub fn fire(&self) {
        self.0.fire();
    }

    pub fn signal(&self) -> Shutdown {
        self.0.signal()
    }
}

impl Default for FiresOnDrop {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for FiresOnDrop {
    fn drop(&mut self) {
        self.0.fire();
    }
}

impl Shutdown {
    /// A signal that never fires: for a task run on its own (a test, a
    /// command), which ends when its work does.
    pub fn never() -> Self {
        Shutdown(None)
    }

    pub fn is_fired(&self) -> bool {
        self.0.as_ref().is_some_and(|rx| *rx.borrow())
    }

    /// Resolves once the shutdown has fired (at once if it has). A trigger
    /// dropped without firing is no shutdown: this then never resolves.
    pub async fn fired(&mut self) {
        match &mut self.0 {
            Some(rx) => {
                if rx.wait_for(|fired| *fired).await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn every_signal_sees_the_trigger_fire_whenever_it_was_made() {
        let (trigger, mut early) = channel();
        let mut cloned = early.clone();
        assert!(!early.is_fired());
        let waiting = tokio::spawn(async move {
            cloned.fired().await;
        });
        trigger.fire();
        early.fired().await;
        assert!(early.is_fired());
        let mut late = trigger.signal();
        assert!(late.is_fired());
        late.fired().await;
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("a clone made before the trigger fired saw it")
            .unwrap();
    }

    #[tokio::test]
    async fn never_and_a_dropped_trigger_do_not_fire() {
        let mut never = Shutdown::never();
        assert!(!never.is_fired());
        let waited = tokio::time::timeout(Duration::from_millis(50), never.fired()).await;
        assert!(waited.is_err());
        let (trigger, mut signal) = channel();
        drop(trigger);
        let waited = tokio::time::timeout(Duration::from_millis(50), signal.fired()).await;
        assert!(waited.is_err(), "a dropped trigger is not a shutdown");
    }

    #[tokio::test]
    async fn a_trigger_that_fires_on_drop_does_when_dropped_unfired() {
        let owner = FiresOnDrop::new();
        let mut before = owner.signal();
        let waiting = tokio::spawn(async move { before.fired().await });
        let mut after = owner.signal();
        assert!(!after.is_fired());
        drop(owner);
        assert!(after.is_fired());
        after.fired().await;
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("a signal made before the drop saw it")
            .unwrap();
        let fired = FiresOnDrop::new();
        let signal = fired.signal();
        fired.fire();
        drop(fired);
        assert!(signal.is_fired());
    }

    #[tokio::test]
    async fn fired_is_cancel_safe_in_a_select_loop() {
        let (trigger, mut signal) = channel();
        let mut turns = 0;
        let mut tick = tokio::time::interval(Duration::from_millis(1));
        loop {
            tokio::select! {
                () = signal.fired() => break,
                _ = tick.tick() => {
                    turns += 1;
                    if turns == 20 {
                        trigger.fire();
                    }
                }
            }
        }
        assert!(turns >= 20);
    }
}
