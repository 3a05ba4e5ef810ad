//! Logging: the subscriber (human-readable or JSON lines, filtered by
//! `log.level` or `RUST_LOG`, reloadable on SIGHUP), and [`LogThrottle`]
//! for events that can repeat once per request.
//!
//! Why a throttle: during a database outage every cold key fails, and under a
//! flood that is thousands of identical lines a second, enough to fill a disk
//! or a log bill while telling the operator nothing the first line did not.
//! The metrics count every occurrence; the log says it is happening, once per
//! interval, with how many it left out.
//!
//! # Targets
//! - `bloomgate::access`: the switch of the access lines (`log.access`);
//!   the lines themselves are written by [`crate::access`], outside this
//!   subscriber, and the `request` span that puts a waiting request's id
//!   on every line logged inside it is this target's;
//! - `bloomgate::audit`: admin actions and refused admin tokens;
//! - sqlx's per-statement lines are off at the source (`db::tls`), and
//!   Postgres's notices (`relation already exists, skipping`: migration
//!   chatter) are shown from `warn` up unless the filter names sqlx.
//!
//! # JSON fields are typed
//! Numbers and booleans are JSON numbers and booleans (durations are logged
//! as numbers of seconds or milliseconds, never as `"1.2s"`); a value whose
//! text is a JSON array or object (`columns = ?vec`, the effective config)
//! is written as that array or object, not as a string.

use std::io::IsTerminal;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormattedFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Registry, reload};

use crate::config::{LogConfig, LogFormat};

/// The target of access lines (their switch) and of the per-request span.
pub const ACCESS: &str = "bloomgate::access";
/// The target of audit lines (admin actions, refused admin tokens).
pub const AUDIT: &str = "bloomgate::audit";

static RELOAD: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();

/// Whether the subscriber lets [`ACCESS`] through at INFO, as
/// [`read_access_switch`] last found.
static ACCESS_ON: AtomicBool = AtomicBool::new(false);

/// Whether access lines are on: read by every request, so a load of what
/// the filter said when it was set ([`init`], [`reload`]), not a question
/// to the subscriber (`tracing::enabled!` asks the filter each time: about
/// 150 instructions, a tenth of the line's cost).
pub fn access_on() -> bool {
    ACCESS_ON.load(Ordering::Relaxed)
}

/// Sets [`access_on`] from the subscriber in force on this thread: what
/// [`init`] and [`reload`] do once the filter is in place, and what a
/// process that installs a subscriber of its own (a test) calls after.
pub fn read_access_switch() {
    ACCESS_ON.store(
        tracing::enabled!(target: ACCESS, tracing::Level::INFO),
        Ordering::Relaxed,
    );
}

/// The filter `cfg` asks for: `RUST_LOG` or `log.level` (access lines are
/// `info`: a level above it leaves them out too), access lines off with
/// `log.access = false`, and Postgres's notices from `warn` up, unless the
/// filter itself names sqlx or the access target.
pub fn filter_directives(cfg: &LogConfig) -> String {
    let base = std::env::var("RUST_LOG").unwrap_or_else(|_| cfg.level.clone());
    let mut text = base.trim().to_string();
    if !text.contains("sqlx") {
        text.push_str(",sqlx::postgres::notice=warn");
    }
    if !cfg.access && !text.contains(ACCESS) {
        text.push_str(",bloomgate::access=off");
    }
    text.trim_start_matches(',').to_string()
}

/// Installs the global subscriber; a second call (tests) is a no-op.
pub fn init(cfg: &LogConfig) {
    let filter = EnvFilter::try_new(filter_directives(cfg))
        .unwrap_or_else(|_| EnvFilter::new(filter_directives(&LogConfig::default())));
    let (filter, handle) = reload::Layer::new(filter);
    // Colours only on a terminal: escape codes in a file, a pipe or a log
    // collector are noise that breaks grep.
    let ansi = std::io::stdout().is_terminal();
    let (human, json) = match cfg.format {
        LogFormat::Human => (Some(tracing_subscriber::fmt::layer().with_ansi(ansi)), None),
        LogFormat::Json => (
            None,
            Some(
                tracing_subscriber::fmt::layer()
                    .fmt_fields(JsonFields::new())
                    .event_format(TypedJson),
            ),
        ),
    };
    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(human)
        .with(json)
        .try_init();
    if installed.is_ok() {
        let _ = RELOAD.set(handle);
    }
    // Whichever subscriber is in force: this one, or one installed before
    // (an embedder, a test harness).
    read_access_switch();
}

/// Applies a new `log.level` / `log.access` (SIGHUP). An invalid filter is
/// refused with the reason, and the one in force stays.
pub fn reload(cfg: &LogConfig) -> Result<String, String> {
    let directives = filter_directives(cfg);
    let filter = EnvFilter::try_new(&directives).map_err(|e| e.to_string())?;
    let handle = RELOAD
        .get()
        .ok_or_else(|| "logging was not set up by this process".to_string())?;
    handle.reload(filter).map_err(|e| e.to_string())?;
    read_access_switch();
    Ok(directives)
}

/// JSON lines whose fields keep their types (see the module doc): `{"timestamp",
/// "level", "target", "fields": {...}, "span": {...}}`, `span` being the
/// innermost span's fields (the request id, inside a request).
struct TypedJson;

impl<S, N> FormatEvent<S, N> for TypedJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        let mut fields = Fields(serde_json::Map::new());
        event.record(&mut fields);
        let mut line = serde_json::Map::new();
        line.insert("timestamp".into(), timestamp.into());
        line.insert("level".into(), event.metadata().level().as_str().into());
        line.insert("target".into(), event.metadata().target().into());
        line.insert("fields".into(), fields.0.into());
        if let Some(span) = ctx.lookup_current() {
            let ext = span.extensions();
            let recorded = ext
                .get::<FormattedFields<N>>()
                .and_then(|f| serde_json::from_str::<serde_json::Value>(f).ok())
                .unwrap_or_else(|| serde_json::Value::Object(Default::default()));
            let mut object = match recorded {
                serde_json::Value::Object(o) => o,
                _ => serde_json::Map::new(),
            };
            object.insert("name".into(), span.name().into());
            line.insert("span".into(), object.into());
        }
        let text = serde_json::to_string(&line).map_err(|_| std::fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// An event's fields as JSON values, typed (see the module doc).
struct Fields(serde_json::Map<String, serde_json::Value>);

impl Visit for Fields {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name().into(), value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let text = format!("{value:?}");
        self.0.insert(field.name().into(), structured(text));
    }
}

/// `text` as the JSON array or object it spells, else as a string.
fn structured(text: String) -> serde_json::Value {
    if (text.starts_with('[') || text.starts_with('{'))
        && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
        && (v.is_array() || v.is_object())
    {
        return v;
    }
    serde_json::Value::String(text)
}

/// Lets one occurrence of a recurring event through per interval.
///
/// Guarantees: the first occurrence is always let through; after one is let
/// through, none is for `interval`; the next one let through reports exactly
/// how many were held back in between (across threads: the count is taken
/// with the same atomic swap that opens the window, so none is counted twice
/// or lost). Lock-free: two atomics, no allocation.
#[derive(Debug)]
pub struct LogThrottle {
    epoch: Instant,
    interval_ms: u64,
    /// Milliseconds since `epoch` before which occurrences are held back.
    next_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl LogThrottle {
    /// Default interval for per-request events.
    pub const INTERVAL: Duration = Duration::from_secs(10);

    pub fn new(interval: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            interval_ms: interval.as_millis().try_into().unwrap_or(u64::MAX),
            next_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(held back since the last line)` if this occurrence should be
    /// logged, `None` if it is one to leave out.
    pub fn permit(&self) -> Option<u64> {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.permit_at(now)
    }

    fn permit_at(&self, now_ms: u64) -> Option<u64> {
        let next = self.next_ms.load(Ordering::Acquire);
        if now_ms >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now_ms.saturating_add(self.interval_ms),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
        {
            Some(self.suppressed.swap(0, Ordering::AcqRel))
        } else {
            self.suppressed.fetch_add(1, Ordering::AcqRel);
            None
        }
    }
}

impl Default for LogThrottle {
    fn default() -> Self {
        Self::new(Self::INTERVAL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn arrays_and_objects_stay_structured_and_the_rest_is_text() {
        assert_eq!(
            structured(format!("{:?}", vec!["id", "email"])),
            serde_json::json!(["id", "email"])
        );
        assert_eq!(structured(r#"{"a":1}"#.into()), serde_json::json!({"a": 1}));
        assert_eq!(structured("1.5s".into()), serde_json::json!("1.5s"));
        assert_eq!(
            structured("[not json".into()),
            serde_json::json!("[not json")
        );
        assert_eq!(structured("12".into()), serde_json::json!("12"));
    }

    #[test]
    fn the_filter_adds_the_access_switch_and_quiets_postgres_notices() {
        let mut cfg = LogConfig::default();
        if std::env::var_os("RUST_LOG").is_some() {
            return;
        }
        assert_eq!(filter_directives(&cfg), "info,sqlx::postgres::notice=warn");
        cfg.access = false;
        cfg.level = "debug,sqlx=debug".into();
        assert_eq!(
            filter_directives(&cfg),
            "debug,sqlx=debug,bloomgate::access=off"
        );
    }

    #[test]
    fn one_line_per_interval_with_the_count_left_out() {
        let t = LogThrottle::new(Duration::from_millis(100));
        assert_eq!(t.permit_at(5), Some(0));
        assert_eq!(t.permit_at(5), None);
        assert_eq!(t.permit_at(104), None);
        assert_eq!(t.permit_at(105), Some(2));
        assert_eq!(t.permit_at(150), None);
        // A long quiet spell: the next occurrence is let through at once.
        assert_eq!(t.permit_at(10_000), Some(1));
        assert_eq!(t.permit_at(10_000), None);
    }

    #[test]
    fn concurrent_occurrences_are_each_counted_once() {
        // One window for the whole test: exactly one permit, and every other
        // occurrence is in the count the next permit reports.
        let t = Arc::new(LogThrottle::new(Duration::from_secs(3600)));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || (0..10_000).filter(|_| t.permit_at(1).is_some()).count())
            })
            .collect();
        let permitted: usize = threads.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(permitted, 1);
        assert_eq!(t.permit_at(u64::MAX), Some(39_999));
    }
}
