//! The names the configuration accepts: SQL identifiers (tables, columns,
//! a route's parameter) and resource names.

/// A plain SQL identifier: we quote it anyway, but refusing anything else
/// keeps SQL out of the config entirely.
pub fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && s.len() <= 63
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `table` or `schema.table`, each part an identifier.
pub fn is_table(s: &str) -> bool {
    s.split('.').all(is_identifier) && s.split('.').count() <= 2
}

/// A resource's name, as logs, metrics and the admin API show it.
pub fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_plain() {
        for ok in ["users", "_x", "a1", "public"] {
            assert!(is_identifier(ok), "{ok}");
        }
        for bad in ["", "1a", "a-b", "a b", "a;", &"x".repeat(64)] {
            assert!(!is_identifier(bad), "{bad}");
        }
        assert!(is_table("public.users") && is_table("users"));
        assert!(!is_table("a.b.c") && !is_table("a.") && !is_table("users; DROP"));
        assert!(is_name("users-v2") && !is_name("") && !is_name("a b"));
    }
}
