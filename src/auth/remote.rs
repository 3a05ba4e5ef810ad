//! `auth.jwks_url`: the key set fetched at start-up, every
//! `jwks_refresh_interval` and when a token names an unknown `kid`, and
//! what the keys held are worth while fetches fail.
//!
//! A fetched set that parses is the identity provider's current word: it
//! replaces the keys held whatever it holds, an empty set included (which
//! revokes every key, logged at error), and a change drops every cached
//! verification. A fetch that fails keeps the keys of the last good one,
//! for `auth.jwks_max_stale` only: past it they are dropped, the gateway
//! is not ready (`Auth::why_not_ready` says why) and their tokens are
//! answered 503, until a fetch succeeds. Tested in `tests/it/auth/checks.rs`
//! (`a_rotated_key_set_…`, `an_empty_key_set_revokes_…`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use super::jwks::JwksError;
use super::{Auth, jwks, jwt};
use crate::config::auth::AuthConfig;
use crate::telemetry::LogThrottle;

/// `auth.jwks_url` and its refresher's state.
pub(super) struct Remote {
    pub(super) url: String,
    pub(super) refresh: Duration,
    pub(super) min_refetch: Duration,
    pub(super) tls: Option<Arc<rustls::ClientConfig>>,
    /// `auth.jwks_max_stale`.
    pub(super) max_stale: Duration,
    pub(super) keys: Mutex<Vec<jwt::PublicKey>>,
    /// A key set is held and trusted: fetched, and not dropped as stale.
    pub(super) loaded: AtomicBool,
    /// When the last good fetch was, on the monotonic clock.
    pub(super) ok_at: Mutex<Option<Instant>>,
    /// Why the keys were dropped (`jwks_max_stale` passed), for `/readyz`.
    pub(super) stale: Mutex<Option<String>>,
    pub(super) started: AtomicBool,
    pub(super) wanted: Arc<tokio::sync::Notify>,
    pub(super) last_ok: Mutex<Option<SystemTime>>,
    pub(super) failure_log: LogThrottle,
}

impl Remote {
    pub(super) fn new(url: &str, cfg: &AuthConfig) -> Self {
        Remote {
            url: url.to_string(),
            refresh: cfg.jwks_refresh_interval,
            min_refetch: cfg.jwks_min_refetch_interval,
            max_stale: cfg.jwks_max_stale,
            tls: if url.starts_with("https:") {
                match jwks::tls_config() {
                    Ok(t) => Some(t),
                    Err(e) => {
                        tracing::warn!(error = %e, "auth.jwks_url: no TLS configuration; fetches will fail");
                        None
                    }
                }
            } else {
                None
            },
            keys: Mutex::new(Vec::new()),
            loaded: AtomicBool::new(false),
            ok_at: Mutex::new(None),
            stale: Mutex::new(None),
            started: AtomicBool::new(false),
            wanted: Arc::new(tokio::sync::Notify::new()),
            last_ok: Mutex::new(None),
            failure_log: LogThrottle::default(),
        }
    }
}

impl Auth {
    /// Starts the `jwks_url` refresher, once; nothing without a URL or
    /// outside a runtime. It ends when the gateway is dropped.
    pub fn start(self: &Arc<Self>) {
        let Some(remote) = &self.remote else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if remote.started.swap(true, Ordering::AcqRel) {
            return;
        }
        runtime.spawn(refresh(Arc::downgrade(self), self.stop.signal()));
    }

    /// Fetches `jwks_url` once and installs what it holds.
    async fn fetch_once(&self, remote: &Remote) -> Result<usize, JwksError> {
        self.stats.jwks_fetches.fetch_add(1, Ordering::Relaxed);
        let body = jwks::fetch(&remote.url, remote.tls.as_ref()).await?;
        let (keys, skipped) = jwks::parse(&body)?;
        // A set that parses is the provider's current word, an empty one
        // too: keeping keys it no longer lists would keep accepting
        // tokens it meant to revoke.
        if keys.is_empty() {
            tracing::error!(
                skipped = %skipped.join("; "),
                "auth.jwks_url: the key set holds no usable key; every token signed by a key \
                 it held is refused from now on"
            );
        }
        let n = keys.len();
        let changed = {
            let mut held = remote.keys.lock().unwrap_or_else(|e| e.into_inner());
            let changed = *held != keys || !remote.loaded.load(Ordering::Acquire);
            if changed {
                *held = keys;
                let mut all = self.file_keys.clone();
                all.extend(held.iter().cloned());
                self.keys.store(Arc::new(all));
            }
            changed
        };
        if changed {
            // After the new keys are in: nothing verified against the old
            // set is served from here on (a removed key's tokens included).
            self.verified.new_generation();
            self.stats.jwks_changes.fetch_add(1, Ordering::Relaxed);
            let held = self.keys.load();
            let kids: Vec<&str> = held.iter().filter_map(|k| k.kid.as_deref()).collect();
            tracing::info!(
                keys = n,
                ?kids,
                skipped = skipped.len(),
                "auth.jwks_url: key set loaded"
            );
            for s in &skipped {
                tracing::warn!(skipped = %s, "auth.jwks_url: a key was skipped");
            }
        }
        *remote.last_ok.lock().unwrap_or_else(|e| e.into_inner()) = Some(SystemTime::now());
        *remote.ok_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        *remote.stale.lock().unwrap_or_else(|e| e.into_inner()) = None;
        remote.loaded.store(true, Ordering::Release);
        Ok(n)
    }

    /// How long the keys held stay trusted without a good fetch: `None`
    /// if none are held (never fetched, or dropped already).
    fn trusted_for(&self, remote: &Remote) -> Option<Duration> {
        if !remote.loaded.load(Ordering::Acquire) {
            return None;
        }
        let ok_at = (*remote.ok_at.lock().unwrap_or_else(|e| e.into_inner()))?;
        Some(remote.max_stale.saturating_sub(ok_at.elapsed()))
    }

    /// `jwks_max_stale` has passed since the last good fetch: the URL's
    /// keys are no longer trusted. Tokens signed by them are answered as
    /// before the first fetch (503) until a fetch succeeds.
    fn drop_stale(&self, remote: &Remote, last_error: &JwksError) {
        {
            let mut held = remote.keys.lock().unwrap_or_else(|e| e.into_inner());
            held.clear();
            self.keys.store(Arc::new(self.file_keys.clone()));
            let why = format!(
                "the key set at auth.jwks_url could not be fetched for auth.jwks_max_stale ({}): \
                 its keys are no longer trusted ({last_error})",
                humantime::format_duration(remote.max_stale)
            );
            tracing::error!(reason = %why, "auth.jwks_url: keys dropped");
            *remote.stale.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
            remote.loaded.store(false, Ordering::Release);
        }
        self.verified.new_generation();
        self.stats.jwks_changes.fetch_add(1, Ordering::Relaxed);
    }
}

async fn refresh(auth: Weak<Auth>, mut stop: crate::shutdown::Shutdown) {
    let mut failures: u32 = 0;
    loop {
        let Some(a) = auth.upgrade() else { return };
        let Some(remote) = a.remote.as_ref() else {
            return;
        };
        let began = Instant::now();
        let next = match a.fetch_once(remote).await {
            Ok(_) => {
                failures = 0;
                remote.refresh
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                a.stats.jwks_fetch_failures.fetch_add(1, Ordering::Relaxed);
                if let Some(not_logged) = remote.failure_log.permit() {
                    tracing::warn!(
                        error = %e,
                        failures,
                        not_logged,
                        "auth.jwks_url: fetching the key set failed; the keys held stay \
                         until auth.jwks_max_stale (at most one such line per 10 s)"
                    );
                }
                // 1 s, doubling, up to the refresh interval; and no later
                // than when the keys held stop being trusted.
                let backoff = Duration::from_secs(1 << failures.min(16).saturating_sub(1))
                    .min(remote.refresh);
                match a.trusted_for(remote) {
                    Some(left) if left.is_zero() => {
                        a.drop_stale(remote, &e);
                        backoff
                    }
                    Some(left) => backoff.min(left),
                    None => backoff,
                }
            }
        };
        let (wanted, min_refetch) = (remote.wanted.clone(), remote.min_refetch);
        drop(a);
        tokio::select! {
            () = tokio::time::sleep(next) => {}
            () = wanted.notified() => {
                // An unknown `kid` asked: not sooner than the minimum
                // interval after the last fetch, whoever asks how often.
                let since = began.elapsed();
                if since < min_refetch {
                    tokio::select! {
                        () = tokio::time::sleep(min_refetch - since) => {}
                        () = stop.fired() => return,
                    }
                }
            }
            () = stop.fired() => return,
        }
    }
}
