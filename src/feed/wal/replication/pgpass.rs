//! The password file (`~/.pgpass`, or the file `PGPASSFILE` names) for the
//! replication connection: sqlx reads it for the pool but keeps what it
//! found to itself, and an operator who keeps the password there must not
//! see the pool connect and the WAL feed fail. So the file is looked up
//! exactly as sqlx looks it up for the pool.
//!
//! # Guarantees (tested below)
//! - Lines are `host:port:database:user:password`; `*` in any of the first
//!   four fields matches anything; `\:` and `\\` are a literal `:` and `\`;
//!   `#` starts a comment line. The first matching line wins.
//! - As sqlx does: `PGPASSFILE` first, then `~/.pgpass` when it has no
//!   matching line; the host matched is the connection's host setting (a
//!   Unix-socket connection keeps the default `localhost`); with no
//!   database in the URL the database field must be `*`.
//! - As libpq does: a file that the group or others may read is ignored
//!   (with a warning naming the path, never its content), and an empty
//!   password is none.
//! - Nothing read here is ever logged.

use std::path::{Path, PathBuf};

/// The password for this connection from the password files, if any.
pub fn lookup(host: &str, port: u16, database: Option<&str>, user: &str) -> Option<String> {
    let named = std::env::var_os("PGPASSFILE").map(PathBuf::from);
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pgpass"));
    named
        .into_iter()
        .chain(home)
        .find_map(|path| lookup_in(&path, host, port, database, user))
}

/// The password for this connection from the file at `path`, if any.
pub fn lookup_in(
    path: &Path,
    host: &str,
    port: u16,
    database: Option<&str>,
    user: &str,
) -> Option<String> {
    let text = read_private(path)?;
    find(&text, host, port, database.unwrap_or(""), user)
}

/// The file's text, unless it is missing or others may read it.
fn read_private(path: &Path) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() {
        return None;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(path = %path.display(), "password file ignored: group or others may read it (chmod 0600)");
            return None;
        }
    }
    std::fs::read_to_string(path).ok()
}

/// The password of the first line of `text` that matches.
fn find(text: &str, host: &str, port: u16, database: &str, user: &str) -> Option<String> {
    let port = port.to_string();
    let want = [host, port.as_str(), database, user];
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(fields)
        .find(|f| {
            f[..4]
                .iter()
                .zip(want)
                .all(|(have, want)| have == "*" || have == want)
        })
        .map(|mut f| f.swap_remove(4))
        .filter(|p| !p.is_empty())
}

/// The five fields of a line, unescaped; `None` for a line with fewer.
/// The password ends at an unescaped `:`, as in libpq.
fn fields(line: &str) -> Option<Vec<String>> {
    let mut out = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.last_mut()?.push(chars.next().unwrap_or('\\')),
            ':' if out.len() < 5 => out.push(String::new()),
            ':' => break,
            c => out.last_mut()?.push(c),
        }
    }
    (out.len() == 5).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "\
# a comment: host:port:db:user:nope
db.internal:5432:app:gw:first
db.internal:5432:app:gw:second
*:5433:*:gw:any\\:host
localhost:*:*:*:back\\\\slash
short:line
";

    #[test]
    fn the_first_matching_line_wins_with_wildcards() {
        assert_eq!(
            find(FILE, "db.internal", 5432, "app", "gw").as_deref(),
            Some("first")
        );
        assert_eq!(
            find(FILE, "elsewhere", 5433, "other", "gw").as_deref(),
            Some("any:host")
        );
        assert_eq!(
            find(FILE, "localhost", 1, "x", "y").as_deref(),
            Some("back\\slash")
        );
        // Every field must match: the user differs, and the port.
        assert_eq!(find(FILE, "db.internal", 5432, "app", "other"), None);
        assert_eq!(find(FILE, "db.internal", 5434, "app", "gw"), None);
        // A comment is not a line to match, nor a line of two fields.
        assert_eq!(find(FILE, "short", 0, "", ""), None);
        assert_eq!(find("# h:1:d:u:p", "# h", 1, "d", "u"), None);
        // An empty password is none; the next matching line is not tried.
        assert_eq!(find("h:1:d:u:\n*:*:*:*:p", "h", 1, "d", "u"), None);
    }

    #[test]
    fn escaped_colons_stay_in_their_field() {
        assert_eq!(
            fields("h\\:x:1:d:u:p\\:w").unwrap(),
            ["h:x", "1", "d", "u", "p:w"]
        );
        // A sixth field is not part of the password.
        assert_eq!(fields("h:1:d:u:p:extra").unwrap()[4], "p");
        assert_eq!(fields("h:1:d:u"), None);
    }

    #[cfg(unix)]
    #[test]
    fn a_file_others_may_read_is_ignored() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("bloomgate-pgpass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pgpass");
        std::fs::write(&path, "*:*:*:*:secret\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_private(&path).as_deref(), Some("*:*:*:*:secret\n"));
        assert_eq!(
            lookup_in(&path, "h", 1, None, "u").as_deref(),
            Some("secret")
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(read_private(&path), None);
        assert_eq!(lookup_in(&path, "h", 1, None, "u"), None);
        // A directory is no password file.
        assert_eq!(read_private(&dir), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
