//! The route grammar, one for the whole gateway: what a `[[resource]]
//! route` may be (checked at load), how a template splits into segments
//! (`http::dispatch` matches by it), and the paths the gateway serves
//! itself, which no resource may take.
//!
//! A route is `/segment/.../{param}`: literal segments of letters, digits
//! and `-_.~`, and exactly one parameter, a whole segment, for the key.

use super::identifier::is_identifier;

/// The public paths the gateway serves beside the resources.
pub const SERVED: [&str; 3] = ["/healthz", "/readyz", "/openapi.json"];

/// The probes among them: what `log.access_probes = false` leaves out of
/// the access log.
pub const PROBES: [&str; 2] = ["/healthz", "/readyz"];

/// The admin API's prefix: reserved on the public listener too, so a path
/// never means one thing there and another on the admin listener.
pub const ADMIN_PREFIX: &str = "/admin";

/// One segment of a route template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segment<'a> {
    Literal(&'a str),
    /// `{name}`: the key's segment.
    Param(&'a str),
}

/// The segments of `template`, after its leading `/`.
pub fn segments(template: &str) -> impl Iterator<Item = Segment<'_>> {
    template
        .strip_prefix('/')
        .unwrap_or(template)
        .split('/')
        .map(
            |s| match s.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                Some(name) => Segment::Param(name),
                None => Segment::Literal(s),
            },
        )
}

/// Whether `route` is the gateway's own: a served path or under the admin
/// prefix.
pub fn is_reserved(route: &str) -> bool {
    route.starts_with(ADMIN_PREFIX) || SERVED.contains(&route)
}

/// Checks `route` against the grammar and the reserved paths.
pub fn check(route: &str) -> Result<(), String> {
    if !route.starts_with('/') {
        return Err(format!("{route:?} must start with '/'"));
    }
    let mut params = 0;
    for segment in segments(route) {
        match segment {
            Segment::Literal("") => return Err(format!("{route:?} has an empty segment")),
            Segment::Param(name) => {
                if !is_identifier(name) {
                    return Err(format!(
                        "{route:?}: parameter {{{name}}} must be an identifier"
                    ));
                }
                params += 1;
            }
            Segment::Literal(seg) => {
                if !seg
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.~".contains(c))
                {
                    return Err(format!(
                        "{route:?}: segment {seg:?} may hold only letters, digits and -_.~"
                    ));
                }
            }
        }
    }
    if params != 1 {
        return Err(format!(
            "{route:?} must have exactly one {{param}} segment for the key"
        ));
    }
    if is_reserved(route) {
        return Err(format!("{route:?} is reserved"));
    }
    Ok(())
}

/// What two routes that clash in the router share: the template with the
/// parameter's name left out.
pub fn shape(route: &str) -> String {
    route
        .split('/')
        .map(|s| if s.starts_with('{') { "{}" } else { s })
        .collect::<Vec<_>>()
        .join("/")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{MINIMAL, err};

    #[test]
    fn routes_have_one_parameter_and_stay_off_the_gateways_paths() {
        assert_eq!(check("/users/{id}"), Ok(()));
        assert_eq!(check("/v1/users/{id}/profile"), Ok(()));
        for (route, problem) in [
            ("users/{id}", "start with '/'"),
            ("/users/{id}/{x}", "exactly one"),
            ("/users", "exactly one"),
            ("/users//{id}", "empty segment"),
            ("/us ers/{id}", "segment"),
            ("/users/{1d}", "identifier"),
            ("/admin/{id}", "reserved"),
            ("/administrators/{id}", "reserved"),
        ] {
            let e = check(route).unwrap_err();
            assert!(e.contains(problem), "{route}: {e}");
        }
        for served in SERVED {
            assert!(is_reserved(served));
        }
    }

    #[test]
    fn segments_and_shapes() {
        assert_eq!(
            segments("/users/{id}").collect::<Vec<_>>(),
            [Segment::Literal("users"), Segment::Param("id")]
        );
        assert_eq!(
            segments("/healthz").collect::<Vec<_>>(),
            [Segment::Literal("healthz")]
        );
        assert_eq!(shape("/users/{id}"), shape("/users/{key}"));
        assert_ne!(shape("/users/{id}"), shape("/people/{id}"));
    }

    /// The route checks as a whole configuration applies them: per
    /// resource, and across resources (clashes, duplicates).
    #[test]
    fn configured_routes_are_checked() {
        for (route, problem) in [
            ("users/{id}", "start with '/'"),
            ("/users/{id}/{x}", "exactly one"),
            ("/users", "exactly one"),
            ("/users//{id}", "empty segment"),
            ("/us ers/{id}", "segment"),
            ("/admin/{id}", "reserved"),
        ] {
            let e = err(&MINIMAL.replace("/users/{id}", route));
            assert!(e.contains(problem), "{route}: {e}");
        }
        let two = format!(
            "{MINIMAL}{}",
            MINIMAL
                .replace("\"users\"\n        route", "\"u2\"\n        route")
                .replace("{id}", "{key}")
        );
        assert!(err(&two).contains("clashes"));
        let dup = format!("{MINIMAL}{}", MINIMAL.replace("/users/", "/people/"));
        assert!(err(&dup).contains("used twice"));
    }
}
