//! The Prometheus text format, and the trait every component's snapshot
//! implements to appear in it.
//!
//! Each component (a resource, the feed, the pool, the server, auth) keeps
//! its own counters and hands out a plain snapshot of them; the snapshot
//! says, in one table next to its fields ([`expose_fields!`]), under which
//! metric name and help each field is exposed. The admin JSON serializes the
//! same snapshot, so a counter is named once: its field.
//!
//! [`Exposition`] collects samples family by family (every sample of a
//! name under one `# HELP` / `# TYPE`, whatever order they come in) and
//! renders them in the order the families were first seen.

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::histogram;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

struct Family {
    name: &'static str,
    help: &'static str,
    kind: Kind,
    samples: String,
}

/// Labels of a sample: name and value; values are escaped when written.
pub type Labels<'a> = &'a [(&'static str, &'a str)];

/// One scrape's text, family by family.
#[derive(Default)]
pub struct Exposition {
    families: Vec<Family>,
    index: HashMap<&'static str, usize>,
}

/// Something that can write itself into an [`Exposition`], every sample
/// carrying `labels` first (`resource`, `feed`, ...).
pub trait Expose {
    fn expose(&self, labels: Labels<'_>, out: &mut Exposition);
}

impl Exposition {
    fn family(&mut self, name: &'static str, help: &'static str, kind: Kind) -> &mut String {
        let i = *self.index.entry(name).or_insert_with(|| {
            self.families.push(Family {
                name,
                help,
                kind,
                samples: String::new(),
            });
            self.families.len() - 1
        });
        debug_assert_eq!(self.families[i].kind, kind, "{name} has one type");
        &mut self.families[i].samples
    }

    pub fn counter(&mut self, name: &'static str, help: &'static str, labels: Labels, v: f64) {
        let out = self.family(name, help, Kind::Counter);
        sample(out, name, "", labels, None, v);
    }

    pub fn gauge(&mut self, name: &'static str, help: &'static str, labels: Labels, v: f64) {
        let out = self.family(name, help, Kind::Gauge);
        sample(out, name, "", labels, None, v);
    }

    /// A gauge that is 1: the `_info` pattern (the labels are the data).
    pub fn info(&mut self, name: &'static str, help: &'static str, labels: Labels) {
        self.gauge(name, help, labels, 1.0);
    }

    /// A cumulative histogram: `_bucket` lines with `le`, `_sum`, `_count`.
    pub fn histogram(
        &mut self,
        name: &'static str,
        help: &'static str,
        labels: Labels,
        s: &histogram::Snapshot,
    ) {
        let out = self.family(name, help, Kind::Histogram);
        let mut le = String::new();
        for (bound, n) in s.bounds.iter().zip(&s.cumulative) {
            le.clear();
            let _ = write!(le, "{bound}");
            sample(out, name, "_bucket", labels, Some(&le), *n as f64);
        }
        sample(out, name, "_bucket", labels, Some("+Inf"), s.count as f64);
        sample(out, name, "_sum", labels, None, s.sum_seconds);
        sample(out, name, "_count", labels, None, s.count as f64);
    }

    /// Every family name written so far, in order.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.families.iter().map(|f| f.name)
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        for f in &self.families {
            let _ = writeln!(out, "# HELP {} {}", f.name, f.help);
            let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind.as_str());
            out.push_str(&f.samples);
            out.push('\n');
        }
        out
    }
}

fn sample(out: &mut String, name: &str, suffix: &str, labels: Labels, le: Option<&str>, v: f64) {
    out.push_str(name);
    out.push_str(suffix);
    let mut labels = labels.iter().filter(|(_, v)| !v.is_empty()).peekable();
    if labels.peek().is_some() || le.is_some() {
        out.push('{');
        let mut first = true;
        for (k, v) in labels {
            if !first {
                out.push(',');
            }
            first = false;
            let _ = write!(out, "{k}=\"{}\"", escape(v));
        }
        if let Some(le) = le {
            if !first {
                out.push(',');
            }
            let _ = write!(out, "le=\"{le}\"");
        }
        out.push('}');
    }
    out.push(' ');
    write_value(out, v);
    out.push('\n');
}

fn write_value(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "+Inf" } else { "-Inf" });
    } else if v.fract() == 0.0 && v.abs() < 9.0e15 {
        let _ = write!(out, "{}", v as i64);
    } else {
        let _ = write!(out, "{v}");
    }
}

/// A label value in the text format: backslash, double quote and newline
/// escaped.
pub fn escape(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return v.into();
    }
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
        .into()
}

/// Implements [`Expose`] for a snapshot struct from one table: each line
/// names a numeric field, its kind (`counter` or `gauge`), the metric name
/// and its help. A field not in the table is in the admin JSON only.
#[macro_export]
macro_rules! expose_fields {
    ($ty:ty { $($field:ident => $kind:ident($name:literal, $help:literal)),* $(,)? }) => {
        impl $crate::exposition::Expose for $ty {
            fn expose(
                &self,
                labels: $crate::exposition::Labels<'_>,
                out: &mut $crate::exposition::Exposition,
            ) {
                $( out.$kind($name, $help, labels, self.$field as f64); )*
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    struct S {
        a: u64,
        b: f64,
    }
    expose_fields!(S {
        a => counter("t_a_total", "A."),
        b => gauge("t_b", "B."),
    });

    #[test]
    fn samples_of_one_name_share_one_family_whatever_the_order() {
        let mut e = Exposition::default();
        S { a: 3, b: 0.5 }.expose(&[("resource", "users")], &mut e);
        S { a: 4, b: 2.0 }.expose(&[("resource", "a\"b")], &mut e);
        let text = e.render();
        assert_eq!(text.matches("# TYPE t_a_total counter").count(), 1);
        assert_eq!(text.matches("# HELP t_b B.").count(), 1);
        assert!(
            text.contains("t_a_total{resource=\"users\"} 3\nt_a_total{resource=\"a\\\"b\"} 4\n")
        );
        assert!(text.contains("t_b{resource=\"users\"} 0.5\n"), "{text}");
        assert!(text.contains("t_b{resource=\"a\\\"b\"} 2\n\n"), "{text}");
    }

    #[test]
    fn an_empty_label_value_is_left_out_and_no_labels_means_no_braces() {
        let mut e = Exposition::default();
        e.counter(
            "x_total",
            "X.",
            &[("resource", ""), ("outcome", "shed")],
            2.0,
        );
        e.gauge("y", "Y.", &[], f64::NAN);
        let text = e.render();
        assert!(text.contains("x_total{outcome=\"shed\"} 2\n"), "{text}");
        assert!(text.contains("\ny NaN\n"), "{text}");
    }

    #[test]
    fn a_histogram_is_cumulative_with_inf_sum_and_count() {
        let h = histogram::Histogram::default();
        h.record(Duration::from_micros(30));
        h.record(Duration::from_secs(9));
        let mut e = Exposition::default();
        e.histogram("h_seconds", "H.", &[("kind", "row")], &h.snapshot());
        let text = e.render();
        assert!(
            text.contains("h_seconds_bucket{kind=\"row\",le=\"0.00005\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("h_seconds_bucket{kind=\"row\",le=\"5\"} 1\n"));
        assert!(text.contains("h_seconds_bucket{kind=\"row\",le=\"+Inf\"} 2\n"));
        assert!(text.contains("h_seconds_count{kind=\"row\"} 2\n"));
        assert_eq!(text.matches("# TYPE h_seconds histogram").count(), 1);
    }
}
