//! The `Cache-Control` grammar the configuration accepts: the response
//! directives of RFC 9111 §5.2.2 and RFC 5861, flags or `name=seconds`.

/// Checks a `Cache-Control` value against the response directives of RFC
/// 9111 §5.2.2 and RFC 5861; returns its largest freshness lifetime
/// (`max-age`, `s-maxage`), if it has one.
pub fn max_age(value: &str) -> Result<Option<u64>, String> {
    const FLAGS: [&str; 9] = [
        "no-cache",
        "no-store",
        "must-revalidate",
        "proxy-revalidate",
        "must-understand",
        "no-transform",
        "public",
        "private",
        "immutable",
    ];
    const SECONDS: [&str; 4] = [
        "max-age",
        "s-maxage",
        "stale-while-revalidate",
        "stale-if-error",
    ];
    if value.trim().is_empty() {
        return Err("must name at least one directive (\"no-cache\", \"max-age=60\")".into());
    }
    let mut max_age = None;
    for d in value.split(',').map(str::trim) {
        let (name, arg) = match d.split_once('=') {
            Some((n, a)) => (n.trim().to_ascii_lowercase(), Some(a.trim())),
            None => (d.to_ascii_lowercase(), None),
        };
        match arg {
            None if FLAGS.contains(&name.as_str()) => {}
            Some(a) if SECONDS.contains(&name.as_str()) => {
                let secs: u64 = a
                    .parse()
                    .map_err(|_| format!("{name} takes a number of seconds, not {a:?}"))?;
                if name == "max-age" || name == "s-maxage" {
                    max_age = max_age.max(Some(secs));
                }
            }
            _ => {
                return Err(format!(
                    "{d:?} is not a response directive this gateway sends \
                     (one of {}, or {}=N)",
                    FLAGS.join(", "),
                    SECONDS.join("=N, ")
                ));
            }
        }
    }
    Ok(max_age)
}
