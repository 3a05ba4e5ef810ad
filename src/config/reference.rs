//! `config/bloomgate.toml` is the reference: every key of every section,
//! in its own section, with the default the code uses. Its guarantees,
//! checked here against the structs (the one source of the defaults):
//!
//! - every field of `[server]`, `[server.cors]`, `[admin]`, `[database]`,
//!   `[log]`, `[filter]`, `[cache]`, `[auth]` and `[bus]` appears in its
//!   section, set or commented out (`# key = example`) (a table of its
//!   own, `[server.cors]`, stands for its field of the section above);
//! - no key appears in a section that has no such field: set keys load,
//!   and so does each commented key uncommented (`deny_unknown_fields`),
//!   so it lands where the struct expects it;
//! - every key set in the file holds the default, except those whose line
//!   says `not the default`;
//! - every commented key, uncommented alone (with the key it replaces, if
//!   any, commented out), loads: its example is a valid value.

use serde_json::Value as Json;

use super::Config;

const FILE: &str = include_str!("../../config/bloomgate.toml");

const SECTIONS: [&str; 9] = [
    "server",
    "server.cors",
    "admin",
    "database",
    "log",
    "filter",
    "cache",
    "auth",
    "bus",
];

/// Examples that stand instead of a key set above them ("not both").
const INSTEAD_OF: [(&str, &str); 1] = [("cache.max_entries", "cache.max_bytes")];

/// Examples that need other examples uncommented with them.
const TOGETHER: [(&str, &[&str]); 6] = [
    ("bus.fleet_key_file", &["bus.url"]),
    ("bus.ca_file", &["bus.url"]),
    ("bus.cert_file", &["bus.url", "bus.key_file"]),
    ("bus.key_file", &["bus.url", "bus.cert_file"]),
    ("bus.sentinels", &["bus.url", "bus.sentinel_master"]),
    ("bus.sentinel_master", &["bus.url", "bus.sentinels"]),
];

/// A line's key if the line sets one (`key = …`), after `# ` if commented.
fn key_of(line: &str, commented: bool) -> Option<&str> {
    let rest = if commented {
        line.strip_prefix("# ")?
    } else {
        line
    };
    let (key, _) = rest.split_once(" = ")?;
    key.bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        .then_some(key)
}

/// Each line with the section it is in (`None` before the first, and from
/// the first `[[resource]]` on: the resources are not sections).
fn lines() -> Vec<(Option<&'static str>, &'static str)> {
    let mut section = None;
    let mut out = Vec::new();
    for line in FILE.lines() {
        if line.starts_with("[[") {
            section = None;
            out.push((None, line));
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = SECTIONS.iter().copied().find(|s| *s == name);
            assert!(section.is_some(), "unknown section [{name}]");
        } else if section.is_some() && line.starts_with("# [[") {
            // A commented resource block ends the section as well.
            section = None;
        }
        out.push((section, line));
    }
    out
}

/// The file with the commented keys `uncomment` (`section.key`)
/// uncommented and the set keys `comment` commented out.
fn edited(uncomment: &[String], comment: &[String]) -> String {
    let mut text = String::new();
    for (section, line) in lines() {
        let path = |k: &str| format!("{}.{k}", section.unwrap_or("?"));
        match (section, key_of(line, true), key_of(line, false)) {
            (Some(_), Some(k), _) if uncomment.contains(&path(k)) => {
                text.push_str(&line[2..]);
            }
            (Some(_), _, Some(k)) if comment.contains(&path(k)) => {
                text.push_str("# ");
                text.push_str(line);
            }
            _ => text.push_str(line),
        }
        text.push('\n');
    }
    text
}

/// `section.key` of every key in the sections, set or commented, and
/// whether it is commented.
fn keys() -> Vec<(String, bool, &'static str)> {
    let mut out = Vec::new();
    for (section, line) in lines() {
        let Some(section) = section else { continue };
        if let Some(k) = key_of(line, false) {
            out.push((format!("{section}.{k}"), false, line));
        } else if let Some(k) = key_of(line, true) {
            out.push((format!("{section}.{k}"), true, line));
        }
    }
    out
}

fn json(c: &Config) -> Json {
    serde_json::to_value(c).unwrap()
}

/// The value at a dotted path (`server.cors`) of `v`.
fn at<'v>(v: &'v Json, path: &str) -> &'v Json {
    path.split('.').fold(v, |v, k| &v[k])
}

/// The TOML table at a dotted path.
fn table_at<'t>(t: &'t toml::Table, path: &str) -> Option<&'t toml::Table> {
    path.split('.')
        .try_fold(t, |t, k| t.get(k).and_then(toml::Value::as_table))
}

/// A section's fields, except those that are sections of their own.
fn fields(section: &str) -> Vec<String> {
    let defaults = json(&Config::default());
    at(&defaults, section)
        .as_object()
        .unwrap_or_else(|| panic!("[{section}] is not a struct"))
        .keys()
        .filter(|k| !SECTIONS.contains(&format!("{section}.{k}").as_str()))
        .cloned()
        .collect()
}

/// Fields left out of the serialized form while unset, with the value
/// they stand for then (`None`: nothing).
const UNSET: [(&str, Option<u64>); 3] = [
    ("cache.max_bytes", Some(super::cache::DEFAULT_MAX_BYTES)),
    ("cache.max_entries", None),
    ("log.access_file", None),
];

/// Every field appears in its section. (A key in a section without such
/// a field fails to load, `deny_unknown_fields`: the shipped keys below,
/// the commented ones in `every_commented_example_loads_uncommented`.)
#[test]
fn every_field_is_in_its_own_section() {
    let keys = keys();
    let mut problems = Vec::new();
    let unset = UNSET.iter().map(|(k, _)| k.to_string());
    let all = SECTIONS
        .iter()
        .flat_map(|s| fields(s).into_iter().map(move |f| format!("{s}.{f}")))
        .chain(unset);
    for path in all {
        if !keys.iter().any(|(k, _, _)| *k == path) {
            problems.push(format!("{path} is missing"));
        }
    }
    assert!(
        problems.is_empty(),
        "config/bloomgate.toml:\n{}",
        problems.join("\n")
    );
}

#[test]
fn every_key_set_holds_the_default_unless_it_says_not() {
    let shipped = Config::from_toml(FILE).expect("the shipped config loads");
    let (shipped, defaults) = (json(&shipped), json(&Config::default()));
    let mut problems = Vec::new();
    let mut deviations = 0;
    for (path, commented, line) in keys() {
        if commented {
            continue;
        }
        let (section, key) = path.rsplit_once('.').unwrap();
        let set = &at(&shipped, section)[key];
        let default = match UNSET.iter().find(|(k, _)| *k == path) {
            // Written as check-config writes it (`config::forms`).
            Some((_, Some(v))) => super::forms::bytes_text(*v).map_or(Json::from(*v), Json::from),
            _ => at(&defaults, section)[key].clone(),
        };
        let default = &default;
        match (set == default, line.contains("not the default")) {
            (true, false) => {}
            (false, true) => deviations += 1,
            (false, false) => problems.push(format!("{path}: {set} but the default is {default}")),
            (true, true) => problems.push(format!("{path} is the default but says it is not")),
        }
    }
    assert!(
        problems.is_empty(),
        "config/bloomgate.toml:\n{}",
        problems.join("\n")
    );
    // The check compares something: the shipped file deviates on purpose
    // in a few places (the demo's triggers).
    assert!(
        deviations > 0,
        "no deviation found: is `not the default` still marked?"
    );
}

#[test]
fn every_commented_example_loads_uncommented() {
    let mut problems = Vec::new();
    let commented: Vec<String> = keys()
        .into_iter()
        .filter(|(_, c, _)| *c)
        .map(|(k, _, _)| k)
        .collect();
    assert!(
        commented.len() > 10,
        "only {} commented keys found",
        commented.len()
    );
    for key in &commented {
        let mut uncomment = vec![key.clone()];
        if let Some((_, with)) = TOGETHER.iter().find(|(k, _)| k == key) {
            uncomment.extend(with.iter().map(|w| w.to_string()));
        }
        let comment: Vec<String> = INSTEAD_OF
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, instead)| instead.to_string())
            .collect();
        let text = edited(&uncomment, &comment);
        // The key really is set now (a typo in the helper would test the
        // file unchanged).
        let table: toml::Table = toml::from_str(&text).expect("TOML");
        let (section, k) = key.rsplit_once('.').unwrap();
        assert!(
            table_at(&table, section).is_some_and(|t| t.get(k).is_some()),
            "{key} not uncommented"
        );
        if let Err(e) = Config::from_toml(&text) {
            problems.push(format!("{key}: {e}"));
        }
    }
    assert!(
        problems.is_empty(),
        "config/bloomgate.toml, uncommented:\n{}",
        problems.join("\n")
    );
}

/// `check-config` prints every key the shipped file sets in the form the
/// file writes it (`"1m"`, not `"60s"` or `"1m 15s"`; `"64 MiB"`, not
/// `67108864`): an operator diffing its output against the file sees only
/// what differs in value.
#[test]
fn check_config_prints_the_files_own_forms() {
    let printed: toml::Table = Config::from_toml(FILE)
        .unwrap()
        .to_redacted_toml()
        .parse()
        .unwrap();
    let mut problems = Vec::new();
    for (path, commented, line) in keys() {
        if commented {
            continue;
        }
        let (section, key) = path.rsplit_once('.').unwrap();
        let written = line.split_once('=').unwrap().1;
        let written = written.split(" #").next().unwrap().trim();
        let written: toml::Table = format!("v = {written}").parse().unwrap();
        let shown = table_at(&printed, section).and_then(|s| s.get(key));
        if shown != written.get("v") {
            problems.push(format!(
                "{path}: the file says {}, check-config {shown:?}",
                written["v"]
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
