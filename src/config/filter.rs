//! `[filter]` and a resource's `[resource.filter]`: how each membership
//! filter is built and when it is rebuilt.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::KeyProblem;
use crate::filter::Mode;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FilterConfig {
    /// Off means every request goes to the cache and database (for
    /// measuring what the filter saves). Default true.
    pub enabled: bool,
    /// `bloom`, `exact` (bigint keys only) or `auto` (the smaller of the two
    /// for the actual keys). Default `auto`.
    pub mode: Mode,
    /// Target false-positive rate of the Bloom filter, in (0, 1).
    /// Default 0.01.
    pub false_positive_rate: f64,
    /// The filter is sized for `rows × headroom` keys so inserts between
    /// rebuilds do not push the false-positive rate over target. Default 1.5.
    pub headroom: f64,
    /// Time between scheduled rebuilds, jittered ±10 %; `0s` disables them.
    /// Default `10m`.
    #[serde(with = "crate::config::forms::duration")]
    pub rebuild_interval: Duration,
    /// A rebuild that finds fewer than `(1 - max_shrink) × ` the current key
    /// count is refused as suspicious (truncated table, wrong database)
    /// unless forced. Default 0.5.
    pub max_shrink: f64,
    /// For `bigint` keys: a key above the highest one the filter holds (a
    /// row committed a moment ago, its notification still on the way) is
    /// checked against the database instead of rejected, at most
    /// `verify_budget` times a second; past that budget it is rejected as
    /// usual. Default false.
    pub verify_above_high_water: bool,
    /// Database checks per second allowed by `verify_above_high_water`
    /// (also spent on confirming announced keys above the mark before they
    /// may raise it). Default 100.
    pub verify_budget: u32,
    /// Rebuild as soon as the estimated false-positive rate of the live
    /// Bloom filter (the sizing model at its key count) exceeds this
    /// multiple of `false_positive_rate`; `0` disables. At least 1.
    /// Default 2.
    pub rebuild_fp_multiple: f64,
    /// Rebuild as soon as the deletes applied since the last build exceed
    /// this fraction of the keys it found (deleted keys stay in the filter
    /// and pass it); `0` disables. Must be below `max_shrink`, or that
    /// rebuild would be refused. Default 0.25.
    pub rebuild_delete_fraction: f64,
    /// Rebuild as soon as live inserts since the last build exceed this
    /// multiple of the keys it found (at least 1024 inserts): bounds the
    /// growth of an exact set that forged notifications could otherwise
    /// grow until the next scheduled rebuild; `0` disables. Default 1.
    pub rebuild_insert_fraction: f64,
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            mode: Mode::Auto,
            false_positive_rate: 0.01,
            headroom: 1.5,
            rebuild_interval: Duration::from_secs(600),
            max_shrink: 0.5,
            verify_above_high_water: false,
            verify_budget: 100,
            rebuild_fp_multiple: 2.0,
            rebuild_delete_fraction: 0.25,
            rebuild_insert_fraction: 1.0,
        }
    }
}

/// Any field left out keeps the global `[filter]` value.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FilterOverrides {
    pub enabled: Option<bool>,
    pub mode: Option<Mode>,
    pub false_positive_rate: Option<f64>,
    pub headroom: Option<f64>,
    #[serde(default, with = "crate::config::forms::duration")]
    pub rebuild_interval: Option<Duration>,
    pub max_shrink: Option<f64>,
    pub verify_above_high_water: Option<bool>,
    pub verify_budget: Option<u32>,
    pub rebuild_fp_multiple: Option<f64>,
    pub rebuild_delete_fraction: Option<f64>,
    pub rebuild_insert_fraction: Option<f64>,
}

impl FilterOverrides {
    /// The section with this resource's values where it has them.
    pub(super) fn apply(&self, base: &FilterConfig) -> FilterConfig {
        FilterConfig {
            enabled: self.enabled.unwrap_or(base.enabled),
            mode: self.mode.unwrap_or(base.mode),
            false_positive_rate: self.false_positive_rate.unwrap_or(base.false_positive_rate),
            headroom: self.headroom.unwrap_or(base.headroom),
            rebuild_interval: self.rebuild_interval.unwrap_or(base.rebuild_interval),
            max_shrink: self.max_shrink.unwrap_or(base.max_shrink),
            verify_above_high_water: self
                .verify_above_high_water
                .unwrap_or(base.verify_above_high_water),
            verify_budget: self.verify_budget.unwrap_or(base.verify_budget),
            rebuild_fp_multiple: self.rebuild_fp_multiple.unwrap_or(base.rebuild_fp_multiple),
            rebuild_delete_fraction: self
                .rebuild_delete_fraction
                .unwrap_or(base.rebuild_delete_fraction),
            rebuild_insert_fraction: self
                .rebuild_insert_fraction
                .unwrap_or(base.rebuild_insert_fraction),
        }
    }
}

impl FilterConfig {
    /// `at` is where the section is: `filter`, or `resource[i].filter` for
    /// a resource's resolved one.
    pub(super) fn validate(&self, at: &str) -> Result<(), KeyProblem> {
        let bad = |key: &str, problem: String| Err(KeyProblem::new(format!("{at}.{key}"), problem));
        let p = self.false_positive_rate;
        if !(p > 0.0 && p < 1.0) {
            return bad("false_positive_rate", format!("{p} is not in (0, 1)"));
        }
        if !(self.headroom >= 1.0 && self.headroom <= 100.0) {
            return bad("headroom", format!("{} is not in [1, 100]", self.headroom));
        }
        if !(0.0..=1.0).contains(&self.max_shrink) {
            return bad(
                "max_shrink",
                format!("{} is not in [0, 1]", self.max_shrink),
            );
        }
        let m = self.rebuild_fp_multiple;
        if !(m == 0.0 || (1.0..=1e6).contains(&m)) {
            return bad(
                "rebuild_fp_multiple",
                format!("{m} is neither 0 (off) nor in [1, 1e6]"),
            );
        }
        let d = self.rebuild_delete_fraction;
        if !(0.0..=1.0).contains(&d) {
            return bad("rebuild_delete_fraction", format!("{d} is not in [0, 1]"));
        }
        if d > 0.0 && self.max_shrink < 1.0 && d >= self.max_shrink {
            return bad(
                "rebuild_delete_fraction",
                format!(
                    "{d} must be below max_shrink ({}): the rebuild it asks for would be refused as a shrink",
                    self.max_shrink
                ),
            );
        }
        let g = self.rebuild_insert_fraction;
        if !(0.0..=1e6).contains(&g) {
            return bad("rebuild_insert_fraction", format!("{g} is not in [0, 1e6]"));
        }
        if !self.rebuild_interval.is_zero() && self.rebuild_interval < Duration::from_secs(1) {
            return bad(
                "rebuild_interval",
                "must be at least 1s, or 0s to disable scheduled rebuilds".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::config::tests::{MINIMAL, err};

    #[test]
    fn bad_values_are_refused_naming_the_key() {
        for (prefix, key) in [
            (
                "[filter]\nfalse_positive_rate = 1.5\n",
                "filter.false_positive_rate",
            ),
            (
                "[filter]\nfalse_positive_rate = 0.0\n",
                "filter.false_positive_rate",
            ),
            ("[filter]\nheadroom = 0.5\n", "filter.headroom"),
            ("[filter]\nmax_shrink = 2.0\n", "filter.max_shrink"),
            (
                "[filter]\nrebuild_fp_multiple = 0.5\n",
                "filter.rebuild_fp_multiple",
            ),
            (
                "[filter]\nrebuild_delete_fraction = 1.5\n",
                "filter.rebuild_delete_fraction",
            ),
            (
                "[filter]\nrebuild_delete_fraction = 0.6\n",
                "filter.rebuild_delete_fraction",
            ),
            (
                "[filter]\nrebuild_insert_fraction = -1.0\n",
                "filter.rebuild_insert_fraction",
            ),
            (
                "[filter]\nrebuild_interval = \"10ms\"\n",
                "filter.rebuild_interval",
            ),
        ] {
            let e = err(&format!("{prefix}{MINIMAL}"));
            assert!(e.contains(key), "{prefix}: {e}");
        }
        // Per resource, the key names the resource.
        let e = err(&format!(
            "{MINIMAL}\n[resource.filter]\nrebuild_fp_multiple = 0.9\n"
        ));
        assert!(e.contains("resource[0].filter.rebuild_fp_multiple"), "{e}");
        // Off is 0 for every trigger.
        assert!(
            Config::from_toml(&format!(
                "[filter]\nrebuild_fp_multiple = 0\nrebuild_delete_fraction = 0\nrebuild_insert_fraction = 0\n{MINIMAL}"
            ))
            .is_ok()
        );
    }

    #[test]
    fn exact_mode_needs_integer_keys() {
        let text =
            MINIMAL.replace("\"bigint\"", "\"uuid\"") + "[resource.filter]\nmode = \"exact\"\n";
        assert!(err(&text).contains("resource[0].filter.mode"));
    }
}
