//! The `bloomgate` command: parse arguments, load the config, hand over to
//! the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use bloomgate::auth::key_files::KeyFiles;
use bloomgate::config::{self, Config, ConfigError};

#[derive(Parser)]
#[command(
    version,
    about = "A caching gateway that keeps absent keys away from PostgreSQL"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        #[arg(long, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Print the effective config (file + environment), secrets redacted.
    CheckConfig {
        #[arg(long, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Connect as the configured role and check everything the config
    /// needs of the database: every table, column and key type, the
    /// privileges (SELECT; REPLICATION and the publication for `wal`; the
    /// triggers for `notify` and `queue`; the change table for `queue`) and
    /// replica identities. Prints the GRANT / ALTER statements that are
    /// missing; exits 1 when something is.
    Preflight {
        #[arg(long, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Apply the embedded migrations: the demo schema (`users`, `articles`).
    Migrate {
        #[arg(long, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Create (or replace) the key-change notification triggers: one
    /// function per table (a view's `source_table`), announcing the key
    /// column of every resource on it.
    InstallTriggers {
        #[arg(long, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Prepare the WAL change feed: create (or update) the publication
    /// `database.publication` over every resource table, and remove
    /// bloomgate's notification triggers (writers stop paying for them).
    InstallFeed {
        #[arg(long, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Print an HS256 token signed with `auth.jwt_secret` (set it with
    /// BLOOMGATE_AUTH__JWT_SECRET): for trying the private resources out,
    /// and for the contract checks and benchmarks. Not an identity provider.
    MintToken {
        #[arg(long, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
        /// The `sub` claim (the caller, and the owner of its rows).
        #[arg(long)]
        sub: String,
        /// Scopes, space-separated, in `auth.scope_claim`: a string for
        /// `scope` (RFC 8693), an array of strings for any other claim
        /// (`scp`, `permissions`, Keycloak's `/realm_access/roles`).
        #[arg(long, default_value = "")]
        scope: String,
        /// Any claim, repeatable: `NAME=JSON`, NAME a claim or a JSON
        /// Pointer (`/realm_access/roles`, whose objects are made), JSON
        /// its value (`tenant='"acme"'`, `org_ids='[17,18]'`). Written
        /// last: it replaces what the other options wrote.
        #[arg(long = "claim", value_name = "NAME=JSON", value_parser = claim_arg)]
        claims: Vec<(String, serde_json::Value)>,
        /// Lifetime (`exp` from now), e.g. `15m`, `2h`.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
    },
    /// Insert demo rows (idempotent): users 1..=N and M articles.
    Seed {
        #[arg(long, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
        #[arg(long, default_value_t = 100_000)]
        users: u64,
        #[arg(long, default_value_t = 10_000)]
        articles: u64,
    },
}

/// mimalloc instead of glibc's malloc: a cached hit or a filtered 404 makes
/// about twenty small allocations (the request, its headers, the
/// response), which mimalloc's thread-local free lists serve markedly
/// cheaper, for a few MB more resident memory. The library and its tests
/// keep the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bloomgate: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The configuration at `path` and the key files its `[auth]` names, read
/// together so that every command refuses a file it could not read. The
/// deprecated keys it used are said on stderr (`serve` logs them instead,
/// once its log is set up: [`load_quietly`]).
fn load(path: &std::path::Path) -> Result<(Config, KeyFiles), ConfigError> {
    let loaded = load_quietly(path)?;
    for d in &loaded.0.deprecations {
        eprintln!("warning: {d}");
    }
    Ok(loaded)
}

fn load_quietly(path: &std::path::Path) -> Result<(Config, KeyFiles), ConfigError> {
    let config = Config::load(path)?;
    let key_files = KeyFiles::read(&config.auth, &path.display().to_string())?;
    Ok((config, key_files))
}

async fn run(command: Command) -> Result<(), Box<dyn std::error::Error>> {
    match command {
        Command::Serve { config: path } => {
            let (config, key_files) = load_quietly(&path)?;
            bloomgate::telemetry::init(&config.log);
            for d in &config.deprecations {
                tracing::warn!("{d}");
            }
            bloomgate::server::run(
                config,
                &key_files,
                Some(path),
                bloomgate::server::shutdown_signal(),
            )
            .await?;
        }
        Command::Preflight { config } => {
            let (config, _) = load(&config)?;
            let report = bloomgate::preflight::run(&config).await;
            out(&report.to_string());
            if !report.passed() {
                return Err(
                    format!("{} missing (statements above)", report.missing_count()).into(),
                );
            }
        }
        Command::CheckConfig { config } => {
            let (config, key_files) = load(&config)?;
            out(&config.to_redacted_toml());
            // On stderr, so stdout stays the TOML it always was.
            eprintln!(
                "freshness: {}",
                match config.database.freshness {
                    bloomgate::config::Freshness::Auto =>
                        "auto (start-up chooses wal when the server has wal_level = logical and the role may replicate, otherwise notify, and logs why)",
                    bloomgate::config::Freshness::Wal =>
                        "wal (logical decoding; start-up fails if the server cannot provide it)",
                    bloomgate::config::Freshness::Queue =>
                        "queue (triggers writing to public.bloomgate_changes, polled)",
                    bloomgate::config::Freshness::Notify => "notify (triggers and LISTEN)",
                    bloomgate::config::Freshness::Off =>
                        "off (no change feed: filters change only by rebuilds)",
                }
            );
            if matches!(
                config.database.freshness,
                bloomgate::config::Freshness::Auto | bloomgate::config::Freshness::Wal
            ) {
                eprintln!(
                    "WAL feed delivery: {} (database.wal_poll_interval)",
                    bloomgate::gateway::wal_delivery(&config.database)
                );
            }
            out(&describe_database(config, &key_files).await);
        }
        Command::Migrate { config } => {
            let (config, _) = load(&config)?;
            let db = bloomgate::db::Db::connect_lazy(&config.database)?;
            db.migrate().await?;
            out("migrations applied\n");
        }
        Command::InstallTriggers { config } => {
            let (config, key_files) = load(&config)?;
            let gateway = bloomgate::gateway::Gateway::new(config, &key_files)?;
            let mut failed = 0;
            for (table, r) in gateway.install_triggers().await? {
                match r {
                    Ok(columns) => out(&format!(
                        "{table}: triggers installed, announcing {}\n",
                        columns.join(", ")
                    )),
                    Err(e) => {
                        failed += 1;
                        eprintln!("{table}: cannot install triggers: {e}");
                    }
                }
            }
            if failed > 0 {
                return Err(format!("{failed} table(s) without triggers").into());
            }
        }
        Command::InstallFeed { config } => {
            let (config, key_files) = load(&config)?;
            let publication = config.database.publication.clone();
            let gateway = bloomgate::gateway::Gateway::new(config, &key_files)?;
            gateway.install_feed().await?;
            out(&format!(
                "publication {publication:?} covers every resource table; bloomgate's triggers removed\n"
            ));
        }
        Command::MintToken {
            config,
            sub,
            scope,
            claims: extra,
            ttl,
        } => {
            let (config, _) = load(&config)?;
            // Its bytes, or with auth.jwt_secret_base64 what they decode to
            // (checked when the config was loaded).
            let secret = config
                .auth
                .jwt_secret_bytes()
                .ok_or("auth.jwt_secret is not set (BLOOMGATE_AUTH__JWT_SECRET)")?;
            let exp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs()
                + ttl.as_secs();
            let mut claims = serde_json::json!({ "sub": sub, "exp": exp });
            if !scope.is_empty() {
                let scopes = match config.auth.scope_claim.as_str() {
                    "scope" => scope.into(),
                    _ => scope.split(' ').filter(|s| !s.is_empty()).collect(),
                };
                set_claim(&mut claims, &config.auth.scope_claim, scopes);
            }
            if let Some(iss) = &config.auth.issuer {
                claims["iss"] = iss.as_str().into();
            }
            if let Some(aud) = &config.auth.audience {
                claims["aud"] = aud.as_str().into();
            }
            for (name, value) in extra {
                set_claim(&mut claims, &name, value);
            }
            use bloomgate::auth::jwt;
            let key = jwt::Secret::new(&secret);
            let token = jwt::encode(
                &serde_json::json!({"alg": "HS256", "typ": "JWT"}),
                &claims,
                |m| key.sign(jwt::Alg::HS256, m).unwrap_or_default(),
            );
            out(&format!("{token}\n"));
        }
        Command::Seed {
            config,
            users,
            articles,
        } => {
            let (config, _) = load(&config)?;
            let db = bloomgate::db::Db::connect_lazy(&config.database)?;
            db.migrate().await?;
            let r = bloomgate::seed::seed(db.pool(), users, articles).await?;
            out(&format!(
                "seeded: {} users and {} articles inserted (asked for {users} and {articles}; rows already present are kept) in {:.1?}\n",
                r.users_inserted, r.articles_inserted, r.elapsed
            ));
        }
    }
    Ok(())
}

/// Writes `text` to stdout. A reader that went away (`check-config |
/// head`) ends the output quietly: `print!` would panic on the broken pipe
/// (exit 101).
fn out(text: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("bloomgate: cannot write to stdout: {e}");
            std::process::exit(1);
        }
    }
}

/// What `check-config` can tell from the database, as TOML comments (so the
/// output stays valid TOML): whether it is reachable, what the change feed
/// needs, and each resource's columns with the JSON type the gateway sends
/// for them (as the OpenAPI document declares them). Nothing is changed.
async fn describe_database(config: Config, key_files: &KeyFiles) -> String {
    use std::fmt::Write;
    let freshness = config.database.freshness;
    let Ok(gw) = bloomgate::gateway::Gateway::new(config, key_files) else {
        return String::new();
    };
    let probe = async {
        let ready = bloomgate::feed::wal::prerequisites(gw.db.pool()).await?;
        let columns = bloomgate::http::openapi::read_columns(&gw).await?;
        Ok::<_, sqlx::Error>((ready, columns))
    };
    let mut out = String::from("\n");
    match tokio::time::timeout(std::time::Duration::from_secs(3), probe).await {
        Err(_) => out.push_str("# database: not reachable within 3 s; columns not checked\n"),
        // The server answered and refused: a missing grant (SQLSTATE class
        // 42) or a login it does not take (28, 3D), not an outage.
        Ok(Err(sqlx::Error::Database(e))) if e.code().is_some_and(|c| c.starts_with("42")) => {
            let _ = writeln!(
                out,
                "# database: reachable, but the catalog could not be read ({e}); columns not \
                 checked: bloomgate preflight --config <this file> prints what is missing"
            );
        }
        Ok(Err(sqlx::Error::Database(e)))
            if e.code()
                .is_some_and(|c| c.starts_with("28") || c.starts_with("3D")) =>
        {
            let _ = writeln!(
                out,
                "# database: reachable, but it refused the connection ({e}); columns not checked"
            );
        }
        Ok(Err(e)) => {
            let _ = writeln!(out, "# database: not reachable ({e}); columns not checked");
        }
        Ok(Ok((ready, columns))) => {
            let wal = ready.wal_level == "logical" && ready.can_replicate;
            let _ = writeln!(
                out,
                "# database: reachable; wal_level = {}, REPLICATION: {}; freshness = {:?}: {}",
                ready.wal_level,
                if ready.can_replicate { "yes" } else { "no" },
                freshness,
                if wal {
                    "the WAL feed is possible (with the publication: bloomgate install-feed)"
                } else {
                    "the WAL feed is not possible here (notify)"
                }
            );
            for r in &gw.resources {
                let Some(cols) = columns.get(r.name()) else {
                    let _ = writeln!(
                        out,
                        "# resource {}: table {} not found",
                        r.name(),
                        r.config.table
                    );
                    continue;
                };
                let described: Vec<String> = r
                    .config
                    .columns
                    .iter()
                    .map(|c| match cols.iter().find(|i| &i.name == c) {
                        Some(i) => {
                            let schema =
                                serde_json::to_value(bloomgate::http::openapi::column_schema(i))
                                    .unwrap_or_default();
                            let ty = schema
                                .get("type")
                                .map_or("any".to_string(), |t| t.to_string());
                            format!("{c} {} -> {}", i.declared, ty.replace('"', ""))
                        }
                        None => format!("{c} MISSING"),
                    })
                    .collect();
                let _ = writeln!(out, "# resource {}: {}", r.name(), described.join(", "));
            }
        }
    }
    out
}

/// `--claim NAME=JSON`: the claim and its value.
fn claim_arg(arg: &str) -> Result<(String, serde_json::Value), String> {
    let (name, json) = arg
        .split_once('=')
        .ok_or_else(|| format!("{arg:?} is not NAME=JSON"))?;
    if name.is_empty() || name == "/" {
        return Err(format!("{arg:?}: no claim name before the ="));
    }
    let value = serde_json::from_str(json).map_err(|e| {
        format!(
            "{name}: {json:?} is not JSON ({e}); a string is written with its quotes,              {name}='\"{json}\"'"
        )
    })?;
    Ok((name.to_string(), value))
}

/// Sets the claim `name` names in `claims`: a top-level member, or where a
/// JSON Pointer (`/realm_access/roles`) leads, making the objects on the
/// way (as `auth::jwt` reads it).
fn set_claim(claims: &mut serde_json::Value, name: &str, value: serde_json::Value) {
    let Some(pointer) = name.strip_prefix('/') else {
        claims[name] = value;
        return;
    };
    let mut at = claims;
    let tokens: Vec<String> = pointer
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect();
    let (last, path) = tokens.split_last().expect("split gives at least one");
    for t in path {
        if !at[t.as_str()].is_object() {
            at[t.as_str()] = serde_json::json!({});
        }
        at = &mut at[t.as_str()];
    }
    at[last.as_str()] = value;
}
