//! Where and as whom the replication connection connects: the pool's
//! settings, and the password sqlx does not hand out (the URL's,
//! `PGPASSWORD`, else the password file's).

use std::fmt;

use crate::db::tls;

/// Where and as whom to connect.
#[derive(Clone)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    /// A Unix socket: its directory (`.s.PGSQL.<port>` is appended) or the
    /// socket itself. Used instead of `host` when set.
    pub socket: Option<std::path::PathBuf>,
    pub user: String,
    pub password: Option<String>,
    pub database: String,
    pub application_name: String,
}

impl Endpoint {
    /// The pool's connection settings (host, port, socket, user, database,
    /// as sqlx resolved them from the URL and `PG*` variables) and the
    /// password ([`password_from_url`]: sqlx does not hand it out), else
    /// the password file's ([`super::pgpass`]), as sqlx and libpq do.
    /// How to secure it comes from the same options, with
    /// [`Tls::from_options`], and is passed to [`Connection::connect_with`].
    pub fn new(
        opts: &sqlx::postgres::PgConnectOptions,
        password: Option<String>,
        application_name: &str,
    ) -> Self {
        let database = opts
            .get_database()
            .unwrap_or(opts.get_username())
            .to_owned();
        // Looked up as sqlx looks it up for the pool (see `pgpass`).
        let password = password.or_else(|| {
            super::pgpass::lookup(
                opts.get_host(),
                opts.get_port(),
                opts.get_database(),
                opts.get_username(),
            )
        });
        Self {
            host: opts.get_host().to_owned(),
            port: opts.get_port(),
            // A socket directory given as `host` (sqlx takes `PGHOST` so).
            socket: opts.get_socket().cloned().or_else(|| {
                tls::over_socket(opts).then(|| std::path::PathBuf::from(opts.get_host()))
            }),
            user: opts.get_username().to_owned(),
            password,
            database,
            application_name: application_name.to_owned(),
        }
    }
}

/// The password a connection URL carries (`user:password@` or
/// `?password=`), else `PGPASSWORD`'s. (The password file comes next, in
/// [`Endpoint::new`].)
pub fn password_from_url(url: &str) -> Option<String> {
    let parsed = url::Url::parse(url).ok();
    let in_authority = parsed.as_ref().and_then(|u| {
        u.password().map(|p| {
            percent_encoding::percent_decode_str(p)
                .decode_utf8_lossy()
                .into_owned()
        })
    });
    let in_query = || {
        parsed.as_ref().and_then(|u| {
            u.query_pairs()
                .find(|(k, _)| k == "password")
                .map(|(_, v)| v.into_owned())
        })
    };
    in_authority
        .or_else(in_query)
        .or_else(|| std::env::var("PGPASSWORD").ok())
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the password.
        f.debug_struct("Endpoint")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("socket", &self.socket)
            .field("user", &self.user)
            .field("database", &self.database)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_comes_from_the_url() {
        assert_eq!(
            password_from_url("postgres://u:p%40ss%3Aw@h/db").as_deref(),
            Some("p@ss:w")
        );
        assert_eq!(
            password_from_url("postgres://u@h/db?sslmode=disable&password=s%20t").as_deref(),
            Some("s t")
        );
    }
}
