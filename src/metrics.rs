//! `/metrics`: the Prometheus exposition of one gateway.
//!
//! What is rendered comes from the components' snapshots (see
//! [`crate::exposition`]), passed in by the caller: this module knows no
//! component. It adds what belongs to the process rather than to a
//! gateway: `bloomgate_build_info`, the standard `process_*` metrics,
//! read from `/proc` (Linux) at each scrape, and the process's access log
//! (`bloomgate_access_lines_*`, [`crate::access`]).

use crate::exposition::{Expose, Exposition};

/// The version and commit the binary was built from (`build.rs`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const COMMIT: &str = env!("BLOOMGATE_COMMIT");

#[derive(Default)]
pub struct Metrics {}

impl Metrics {
    /// The exposition text: the build and the process, then `parts`.
    pub fn render(&self, parts: &dyn Expose) -> String {
        let mut out = Exposition::default();
        out.info(
            "bloomgate_build_info",
            "The running binary: version and the commit it was built from.",
            &[("version", VERSION), ("commit", COMMIT)],
        );
        process(&mut out);
        crate::access::stats().expose(&[], &mut out);
        parts.expose(&[], &mut out);
        out.render()
    }
}

/// Clock ticks per second of `/proc`'s CPU times (`USER_HZ`): 100 on
/// every Linux architecture the gateway builds for.
const USER_HZ: f64 = 100.0;

/// The standard process metrics, as far as `/proc` can be read (a missing
/// file leaves its metric out).
fn process(out: &mut Exposition) {
    if let Some(p) = Process::read() {
        out.gauge(
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            &[],
            p.rss_bytes,
        );
        out.gauge(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            &[],
            p.vsize_bytes,
        );
        out.counter(
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            &[],
            p.cpu_seconds,
        );
        if let Some(start) = p.start_time_seconds {
            out.gauge(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                &[],
                start,
            );
        }
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        out.gauge(
            "process_open_fds",
            "Number of open file descriptors.",
            &[],
            fds.count() as f64,
        );
    }
    if let Some(max) = max_fds() {
        out.gauge(
            "process_max_fds",
            "Maximum number of open file descriptors.",
            &[],
            max,
        );
    }
}

struct Process {
    rss_bytes: f64,
    vsize_bytes: f64,
    cpu_seconds: f64,
    start_time_seconds: Option<f64>,
}

impl Process {
    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let kib = |key: &str| -> Option<f64> {
            let v = status.lines().find_map(|l| l.strip_prefix(key))?;
            Some(v.trim().trim_end_matches("kB").trim().parse::<f64>().ok()? * 1024.0)
        };
        let mut p = parse_stat(&stat, boot_time())?;
        p.rss_bytes = kib("VmRSS:")?;
        Some(p)
    }
}

/// `/proc/self/stat`: the fields after the command name (which may hold
/// spaces and parentheses, so the split is at the last `)`). The resident
/// size is read from `/proc/self/status` in bytes instead of pages.
fn parse_stat(stat: &str, btime: Option<f64>) -> Option<Process> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is rest[0]; utime is field 14, stime 15, starttime
    // 22, vsize 23, rss 24 (in pages).
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| f.get(n - 3)?.parse::<f64>().ok();
    Some(Process {
        cpu_seconds: (field(14)? + field(15)?) / USER_HZ,
        start_time_seconds: btime.map(|b| b + field(22).unwrap_or(0.0) / USER_HZ),
        vsize_bytes: field(23)?,
        rss_bytes: 0.0,
    })
}

/// When the system booted, from `/proc/stat`'s `btime`.
fn boot_time() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// The soft limit on open files, from `/proc/self/limits`.
fn max_fds() -> Option<f64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line
        .strip_prefix("Max open files")?
        .split_whitespace()
        .next()?;
    match soft {
        "unlimited" => Some(f64::INFINITY),
        n => n.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;
    impl Expose for Nothing {
        fn expose(&self, _: crate::exposition::Labels<'_>, _: &mut Exposition) {}
    }

    #[test]
    fn the_process_and_the_build_are_exposed() {
        let text = Metrics::default().render(&Nothing);
        for family in [
            "bloomgate_build_info{version=\"",
            "process_resident_memory_bytes ",
            "process_cpu_seconds_total ",
            "process_start_time_seconds ",
            "process_open_fds ",
            "process_max_fds ",
        ] {
            assert!(text.contains(family), "{family}\n{text}");
        }
        let value = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                .unwrap()
                .parse()
                .unwrap()
        };
        assert!(value("process_resident_memory_bytes") > 1e6);
        assert!(value("process_open_fds") >= 3.0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let start = value("process_start_time_seconds");
        assert!(
            start <= now + 1.0 && start > now - 86_400.0 * 365.0,
            "{start}"
        );
    }

    #[test]
    fn a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields() {
        let mut fields = vec!["0"; 50];
        fields[0] = "S";
        fields[14 - 3] = "250";
        fields[15 - 3] = "50";
        fields[22 - 3] = "1000";
        fields[23 - 3] = "4096000";
        let stat = format!("42 (a b) (c)) {}", fields.join(" "));
        let p = parse_stat(&stat, Some(1000.0)).unwrap();
        assert_eq!(p.cpu_seconds, 3.0);
        assert_eq!(p.vsize_bytes, 4096000.0);
        assert_eq!(p.start_time_seconds, Some(1010.0));
    }
}
