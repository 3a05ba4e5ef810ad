//! The route grammar, one for the whole gateway: what a `[[resource]]
//! route` may be (checked at load), how a template splits into segments
//! (`http::dispatch` matches by it), and the paths the gateway serves
//! itself, which no resource may take.
//!
//! A route is `/segment/.../{param}`: literal segments of letters, digits
//! and `-_.~`, and a parameter, a whole segment, for the key: exactly one
//! of any name for a key of one column, or for a composite key one named
//! after each of its columns, in any order
//! (`/tenants/{tenant_id}/orders/{order_no}`).

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

/// For each of `key`'s columns, in its order, the index of its segment
/// in `template.split('/')` (a key of one column: the one parameter's).
/// `None` for a template [`check`] refuses.
pub fn key_segments(template: &str, key: &[&str]) -> Option<Vec<usize>> {
    let params: Vec<(usize, &str)> = template
        .split('/')
        .enumerate()
        .filter_map(|(i, s)| Some((i, s.strip_prefix('{')?.strip_suffix('}')?)))
        .collect();
    match (key, params.as_slice()) {
        ([_], [(i, _)]) => Some(vec![*i]),
        ([_], _) => None,
        _ => key
            .iter()
            .map(|c| params.iter().find(|(_, p)| p == c).map(|(i, _)| *i))
            .collect(),
    }
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

/// Checks `route` against the grammar and the reserved paths, for a key
/// of the columns `key`.
pub fn check(route: &str, key: &[&str]) -> Result<(), String> {
    if !route.starts_with('/') {
        return Err(format!("{route:?} must start with '/'"));
    }
    let mut params: Vec<&str> = Vec::new();
    for segment in segments(route) {
        match segment {
            Segment::Literal("") => return Err(format!("{route:?} has an empty segment")),
            Segment::Param(name) => {
                if !is_identifier(name) {
                    return Err(format!(
                        "{route:?}: parameter {{{name}}} must be an identifier"
                    ));
                }
                if params.contains(&name) {
                    return Err(format!("{route:?}: parameter {{{name}}} appears twice"));
                }
                params.push(name);
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
    match key {
        [_] if params.len() != 1 => {
            return Err(format!(
                "{route:?} must have exactly one {{param}} segment for the key (a composite key names its columns in key_column = [..], each a {{column}} of the route)"
            ));
        }
        [_] => {}
        _ => {
            if let Some(c) = key.iter().find(|c| !params.contains(c)) {
                return Err(format!(
                    "{route:?} has no {{{c}}}: a composite key's every column is a segment of the route, named after it"
                ));
            }
            if let Some(p) = params.iter().find(|p| !key.contains(p)) {
                return Err(format!(
                    "{route:?}: {{{p}}} is not a key column (key_column = [{}])",
                    key.iter()
                        .map(|c| format!("{c:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
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

    /// Routes refused for a key `id`, and what the refusal says.
    const REFUSED: [(&str, &str); 8] = [
        ("users/{id}", "start with '/'"),
        ("/users/{id}/{x}", "exactly one"),
        ("/users", "exactly one"),
        ("/users//{id}", "empty segment"),
        ("/us ers/{id}", "segment"),
        ("/users/{1d}", "identifier"),
        ("/admin/{id}", "reserved"),
        ("/administrators/{id}", "reserved"),
    ];

    #[test]
    fn routes_have_one_parameter_and_stay_off_the_gateways_paths() {
        assert_eq!(check("/users/{id}", &["id"]), Ok(()));
        assert_eq!(check("/users/{uid}", &["id"]), Ok(()));
        assert_eq!(check("/v1/users/{id}/profile", &["id"]), Ok(()));
        for (route, problem) in REFUSED {
            let e = check(route, &["id"]).unwrap_err();
            assert!(e.contains(problem), "{route}: {e}");
        }
        let key = ["tenant_id", "order_no"];
        for ok in [
            "/tenants/{tenant_id}/orders/{order_no}",
            "/orders/{order_no}/of/{tenant_id}",
            "/o/{tenant_id}/{order_no}",
        ] {
            assert_eq!(check(ok, &key), Ok(()), "{ok}");
        }
        for (route, problem) in [
            ("/tenants/{tenant_id}/orders", "no {order_no}"),
            ("/tenants/{tenant_id}/orders/{id}", "no {order_no}"),
            ("/t/{tenant_id}/{order_no}/{x}", "{x} is not a key column"),
            ("/t/{tenant_id}/{order_no}/{tenant_id}", "twice"),
        ] {
            let e = check(route, &key).unwrap_err();
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
        assert_eq!(key_segments("/users/{uid}", &["id"]), Some(vec![2]));
        assert_eq!(key_segments("/o/{b}/x/{a}", &["a", "b"]), Some(vec![4, 2]));
        assert_eq!(key_segments("/o/{b}", &["a", "b"]), None);
        assert_ne!(shape("/users/{id}"), shape("/people/{id}"));
    }

    /// The route checks as a whole configuration applies them: per
    /// resource, and across resources (clashes, duplicates).
    #[test]
    fn configured_routes_are_checked() {
        for (route, problem) in REFUSED {
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
