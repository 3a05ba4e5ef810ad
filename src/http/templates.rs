//! Route templates matched segment by segment ([`Templates`]): which one
//! template, if exactly one, could match a path. The dispatch takes a
//! resource's `GET` past the router with it, and the access lines name a
//! request's route by it.

use crate::config::route;

/// One segment of a route template, as [`route::segments`] splits it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(Box<str>),
    Param,
}

/// Route templates and what each leads to: `Some` for a direct target,
/// `None` for a path only the router serves. Generic so the tests can match
/// without a gateway.
#[derive(Debug)]
pub struct Templates<T> {
    templates: Vec<(Vec<Segment>, Option<T>)>,
    /// Segments of the longest template of at most [`MAX_SEGMENTS`]: a
    /// longer path is left to the router (which also serves the templates
    /// longer than that).
    longest: usize,
}

impl<T> Default for Templates<T> {
    fn default() -> Self {
        Self {
            templates: Vec::new(),
            longest: 0,
        }
    }
}

/// Most segments a direct path can have; a template with more is left to
/// the router (so is every path as long).
pub const MAX_SEGMENTS: usize = 8;

impl<T> Templates<T> {
    /// Adds a template (`/users/{id}`, `/healthz`): `target` is where a
    /// `GET` matching it goes directly, `None` to leave it to the router.
    pub fn add(&mut self, template: &str, target: Option<T>) {
        let segments = route::segments(template)
            .map(|s| match s {
                route::Segment::Param(_) => Segment::Param,
                route::Segment::Literal(l) => Segment::Literal(l.into()),
            })
            .collect::<Vec<_>>();
        // A template too long for `find`'s buffer stays with the router, and
        // so does every path it could match: `find` answers `None` for them.
        if segments.len() <= MAX_SEGMENTS {
            self.longest = self.longest.max(segments.len());
        }
        self.templates.push((segments, target));
    }

    /// The direct target of `path`, if exactly one template could match it
    /// and that template has one.
    pub fn find(&self, path: &str) -> Option<&T> {
        let mut rest = path.strip_prefix('/')?;
        // Split once, for every template (not once per template).
        let mut parts = [""; MAX_SEGMENTS];
        let mut n = 0;
        loop {
            if n == self.longest {
                // More segments than any template has.
                return None;
            }
            match rest.bytes().position(|b| b == b'/') {
                Some(i) => {
                    parts[n] = &rest[..i];
                    rest = &rest[i + 1..];
                    n += 1;
                }
                None => {
                    parts[n] = rest;
                    n += 1;
                    break;
                }
            }
        }
        let parts = &parts[..n];
        let mut found = None;
        for (segments, target) in &self.templates {
            if could_match(segments, parts) {
                if found.is_some() {
                    return None;
                }
                found = Some(target);
            }
        }
        found?.as_ref()
    }
}

fn could_match(segments: &[Segment], parts: &[&str]) -> bool {
    segments.len() == parts.len()
        && segments
            .iter()
            .zip(parts)
            .all(|(segment, p)| match segment {
                Segment::Literal(l) => **l == **p,
                Segment::Param => !p.is_empty(),
            })
}
