//! The front layer's access lines ([`super`], step 2): the route
//! templates a line names (a path is logged as its template, never as
//! itself, so the log holds no keys), what a request carries for its line,
//! and the line written when the response is ready.

use axum::http::{HeaderName, StatusCode};
use axum::response::Response;

use crate::access::{Escaped, Text};
use crate::http::templates::Templates;

/// The route templates of a router, for access lines: a path is logged as
/// its template (`/users/{id}`), never as itself, so the log holds no keys.
#[derive(Debug)]
pub(super) struct AccessRoutes {
    templates: Templates<usize>,
    /// Per template: the template and the resource it serves (empty if
    /// none), escaped for the line once, here.
    names: Vec<(Escaped, Escaped)>,
    /// Per template: its requests have no line
    /// ([`super::FrontLayer::without_lines_for`]).
    unlogged: Vec<bool>,
}

impl AccessRoutes {
    pub(super) fn new(routes: &AccessTemplates) -> Self {
        let names: Vec<(Escaped, Escaped)> = routes
            .iter()
            .map(|(template, resource)| {
                (
                    Escaped::new(template),
                    Escaped::new(resource.as_deref().unwrap_or_default()),
                )
            })
            .collect();
        AccessRoutes {
            templates: access_index(routes),
            unlogged: vec![false; names.len()],
            names,
        }
    }

    /// Requests whose route is one of `templates` get no line.
    pub(super) fn without_lines_for(&mut self, templates: &[&str]) {
        for (i, (template, _)) in self.names.iter().enumerate() {
            self.unlogged[i] |= templates.iter().any(|t| template.as_str() == *t);
        }
    }

    /// The index of the template `path` matches.
    pub(super) fn route_of(&self, path: &str) -> Option<usize> {
        self.templates.find(path).copied()
    }
}

/// Route templates as access lines name them: `(template, resource)`, the
/// resource `None` for routes that serve none ([`super::FrontLayer::with_access`]).
pub type AccessTemplates = Vec<(String, Option<String>)>;

/// The access lines' matcher for `routes` (as [`super::FrontLayer::with_access`]
/// takes them): a path's template by its index among them.
pub(in crate::http) fn access_index(routes: &[(String, Option<String>)]) -> Templates<usize> {
    let mut templates = Templates::default();
    for (i, (template, _)) in routes.iter().enumerate() {
        templates.add(template, Some(i));
    }
    templates
}

/// What an access line needs from the start of the request; made only
/// while access lines are on, and kept in the response future (no box).
/// The route templates are read from the layer's shared state when the
/// line is written (the in-flight slot holds it), not counted per request.
pub(super) struct Access {
    pub began: std::time::Instant,
    pub method: axum::http::Method,
    /// The request id is one the layer made (a UUID: nothing to escape).
    pub id_made: bool,
    pub route: Option<usize>,
    pub client: Option<std::net::IpAddr>,
    /// The connection's address, when a trusted proxy named the client.
    pub peer: Option<std::net::IpAddr>,
}

/// The access line of a request answered with `response`, whose id is
/// `request_id` (the client's or the one made for it; a handler's own
/// `x-request-id`, which none sets, would go to the client but not here:
/// reading it back would cost a lookup per request).
/// `told`: the `Cache-Status` the service told ([`Tells::cache_status`]).
pub(super) fn access_line(
    a: &Access,
    routes: &AccessRoutes,
    response: &Response,
    request_id: &str,
    told: Option<&'static str>,
) {
    let Some(logger) = crate::access::global() else {
        return;
    };
    if a.route
        .is_some_and(|i| routes.unlogged.get(i) == Some(&true))
    {
        return;
    }
    let text = |name: &HeaderName| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    };
    let (route, resource) = a
        .route
        .and_then(|i| routes.names.get(i))
        .map_or((&Escaped::EMPTY, &Escaped::EMPTY), |(t, r)| (t, r));
    let cache_status = match told {
        Some(fixed) => Text::Clean(fixed),
        None => Text::Raw(text(&CACHE_STATUS)),
    };
    let status = response.status();
    // The filter answered and nothing else was touched (`http::lookup`'s
    // `filter-absent`): the one answer an attack can have at any rate, so
    // its lines are limited (`log.access_filtered_rate`).
    let class = if status == StatusCode::NOT_FOUND && cache_status.as_str().ends_with(FILTER_ABSENT)
    {
        crate::access::Class::Filtered
    } else {
        crate::access::Class::Every
    };
    let now = std::time::Instant::now();
    let line = crate::access::Line {
        // `http` holds a method to RFC 9110's token characters.
        method: Text::Clean(a.method.as_str()),
        route,
        status: status.as_u16(),
        cache_status,
        resource,
        duration: now.saturating_duration_since(a.began),
        request_id: match a.id_made {
            true => Text::Clean(request_id),
            false => Text::Raw(request_id),
        },
        client: a.client,
        peer: a.peer,
        reason: response
            .extensions()
            .get::<crate::http::response::Refused>()
            .map(|r| r.0),
    };
    logger.log(&line, class, now);
}

static CACHE_STATUS: HeaderName = HeaderName::from_static("cache-status");
/// The end of a filtered 404's `Cache-Status` (`http::lookup`).
const FILTER_ABSENT: &str = "detail=filter-absent";
