//! The `bloomgate` binary: config errors stop it with a message naming the
//! file, key and problem; `check-config` redacts secrets.

use crate::common;

use std::process::Command;

use common::tempdir;

fn bloomgate(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bloomgate"));
    cmd.args(args).env_remove("DATABASE_URL");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write_config(dir: &std::path::Path, text: &str) -> String {
    let path = dir.join("bloomgate.toml");
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

const RESOURCE: &str = r#"
[[resource]]
name = "users"
route = "/users/{id}"
table = "users"
key_column = "id"
key_type = "bigint"
columns = ["id", "name"]
"#;

#[test]
fn check_config_prints_the_effective_config_with_secrets_redacted() {
    let dir = tempdir();
    let path = write_config(
        &dir,
        &format!("[database]\nurl = \"postgres://app:hunter2@db/x\"\n{RESOURCE}"),
    );
    let (ok, out, err) = bloomgate(
        &["check-config", "--config", &path],
        &[
            ("BLOOMGATE_SERVER__LISTEN", "0.0.0.0:9000"),
            ("BLOOMGATE_DATABASE__WAL_POLL_INTERVAL", "7ms"),
        ],
    );
    assert!(ok, "{err}");
    assert!(out.contains("listen = \"0.0.0.0:9000\""), "{out}");
    // The WAL feed's delivery, from the environment, said on stderr.
    assert!(out.contains("wal_poll_interval = \"7ms\""), "{out}");
    assert!(err.contains("WAL feed delivery: polled every 7ms"), "{err}");
    // No database there: said, not fatal.
    assert!(out.contains("# database: not reachable"), "{out}");
    assert!(out.contains("postgres://app:***@db/x"), "{out}");
    assert!(!out.contains("hunter2") && !err.contains("hunter2"));
}

/// The deprecated `database.listen` (from the file or the environment) is
/// what it stands for in the effective config, and said on stderr by every
/// command that reads the config, as the log says it at `serve`.
#[test]
fn a_deprecated_key_is_folded_and_said() {
    let dir = tempdir();
    let path = write_config(
        &dir,
        &format!("[database]\nurl = \"postgres://127.0.0.1:1/x\"\n{RESOURCE}"),
    );
    let (ok, out, err) = bloomgate(
        &["check-config", "--config", &path],
        &[("BLOOMGATE_DATABASE__LISTEN", "false")],
    );
    assert!(ok, "{err}");
    assert!(out.contains("freshness = \"off\""), "{out}");
    assert!(!out.contains("listen = false"), "{out}");
    assert!(
        err.contains("warning: database.listen = false is deprecated"),
        "{err}"
    );
    let (_, _, err) = bloomgate(
        &["preflight", "--config", &path],
        &[("BLOOMGATE_DATABASE__LISTEN", "false")],
    );
    assert!(
        err.contains("database.listen = false is deprecated"),
        "{err}"
    );
}

#[test]
fn the_shipped_config_is_valid() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config/bloomgate.toml");
    let (ok, out, err) = bloomgate(&["check-config", "--config", path], &[]);
    assert!(ok, "{err}");
    assert!(
        out.contains("/users/{id}") && out.contains("/articles/{id}"),
        "{out}"
    );
}

#[test]
fn bad_configs_fail_naming_file_key_and_problem() {
    let dir = tempdir();
    let cases: [(&str, &[&str]); 4] = [
        (
            &format!("[server]\nlisten = 8080\n{RESOURCE}"),
            &["server.listen", "bloomgate.toml"],
        ),
        (
            &format!("[cache]\nttl_seconds = 3\n{RESOURCE}"),
            &["ttl_seconds"],
        ),
        (
            &RESOURCE.replace("\"users\"\nkey", "\"users;drop\"\nkey"),
            &["resource[0].table", "not a valid SQL identifier"],
        ),
        (
            &format!("[filter]\nfalse_positive_rate = 2.0\n{RESOURCE}"),
            &["filter.false_positive_rate", "not in (0, 1)"],
        ),
    ];
    for (text, needles) in cases {
        let path = write_config(&dir, text);
        for command in ["check-config", "serve"] {
            let (ok, _, err) = bloomgate(&[command, "--config", &path], &[]);
            assert!(!ok, "{command} accepted:\n{text}");
            for n in needles {
                assert!(err.contains(n), "{command}: {err:?} lacks {n:?}");
            }
        }
    }
    let (ok, _, err) = bloomgate(&["serve", "--config", "/no/such/file.toml"], &[]);
    assert!(!ok && err.contains("/no/such/file.toml"), "{err}");
    let path = write_config(&dir, RESOURCE);
    let (ok, _, err) = bloomgate(
        &["serve", "--config", &path],
        &[("BLOOMGATE_SERVER__LISTEN", "nowhere")],
    );
    let lower = err.to_lowercase();
    assert!(
        !ok && lower.contains("server.listen") && err.contains("BLOOMGATE_"),
        "{err}"
    );
}

/// An access file that cannot be opened stops `serve` before it listens,
/// naming the key; a bad `log.access_filtered_rate` stops both commands.
#[test]
fn access_log_settings_are_checked_at_start_up() {
    let dir = tempdir();
    let path = write_config(
        &dir,
        &format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[log]\naccess_file = \"{}\"\n{RESOURCE}",
            dir.join("no-such-dir/access.log").display()
        ),
    );
    let (ok, _, err) = bloomgate(&["serve", "--config", &path], &[]);
    assert!(!ok, "serve started");
    assert!(
        err.contains("log.access_file") && err.contains("no-such-dir/access.log"),
        "{err}"
    );
    assert!(!err.contains("listening"), "{err}");
    let path = write_config(
        &dir,
        &format!("[log]\naccess_filtered_rate = \"often\"\n{RESOURCE}"),
    );
    for command in ["check-config", "serve"] {
        let (ok, _, err) = bloomgate(&[command, "--config", &path], &[]);
        assert!(
            !ok && err.contains("access_filtered_rate"),
            "{command}: {err}"
        );
    }
}

#[test]
fn logs_to_a_pipe_carry_no_colour_codes() {
    let dir = tempdir();
    let path = write_config(
        &dir,
        &format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[database]\nurl = \"postgres://nobody@127.0.0.1:1/x\"\n{RESOURCE}"
        ),
    );
    // Stdout is a pipe here, as under systemd, Docker or a log shipper.
    let mut child = Command::new(env!("CARGO_BIN_EXE_bloomgate"))
        .args(["serve", "--config", &path])
        .env_remove("DATABASE_URL")
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Long enough to bind and to log the first failed database attempt.
    std::thread::sleep(std::time::Duration::from_secs(3));
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("listening"), "{stdout}");
    assert!(
        !stdout.contains('\x1b'),
        "escape codes in piped logs: {stdout:?}"
    );
}

/// figment names a key with its profile in front (`default.database.
/// pool_sise`), a name found nowhere in the file: the error names the key
/// as it is written.
#[test]
fn config_errors_name_the_key_without_the_profile() {
    let dir = tempdir();
    let path = write_config(&dir, &format!("[database]\npool_sise = 3\n{RESOURCE}"));
    let (ok, _, err) = bloomgate(&["check-config", "--config", &path], &[]);
    assert!(!ok);
    assert!(err.contains("database.pool_sise"), "{err}");
    assert!(!err.contains("default."), "{err}");
    let path = write_config(
        &dir,
        &format!("[database]\npool_size = \"many\"\n{RESOURCE}"),
    );
    let (ok, _, err) = bloomgate(&["check-config", "--config", &path], &[]);
    assert!(
        !ok && err.contains(&format!("{path}: database.pool_size: expected u32"))
            && !err.contains("default."),
        "{err}"
    );
}

/// `check-config | head` must not panic when head goes away (exit 101).
/// The output is made larger than a pipe's buffer, so the write fails
/// with the broken pipe whatever the timing.
#[test]
fn check_config_into_a_closed_pipe_exits_quietly() {
    use std::io::Read;
    let dir = tempdir();
    let many: String = (0..400)
        .map(|i| {
            RESOURCE.replace(
                "\"users\"\nroute = \"/users/{id}\"",
                &format!("\"users{i}\"\nroute = \"/users{i}/{{id}}\""),
            )
        })
        .collect();
    let path = write_config(
        &dir,
        &format!("[database]\nurl = \"postgres://nobody@127.0.0.1:1/x\"\n{many}"),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_bloomgate"))
        .args(["check-config", "--config", &path])
        .env_remove("DATABASE_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 1];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(101), "panicked: {stderr}");
    assert!(out.status.success(), "{:?} {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A command run from another directory than the checkout looks for the
/// default `config/bloomgate.toml` there: it says where it looked and how
/// to give another, instead of a bare "not found" (or an empty token).
#[test]
fn a_missing_config_says_where_it_was_looked_for() {
    let dir = tempdir();
    let out = Command::new(env!("CARGO_BIN_EXE_bloomgate"))
        .args(["mint-token", "--sub", "1"])
        .current_dir(&dir)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "a token printed without a config");
    let looked = dir.join("config/bloomgate.toml");
    assert!(
        err.contains(&looked.display().to_string()) && err.contains("--config"),
        "{err}"
    );
}

/// The claims of a token `mint-token` printed, as the gateway reads them.
fn minted_claims(token: &str) -> serde_json::Value {
    use base64::Engine;
    let payload = token.trim().split('.').nth(1).unwrap();
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

/// `--claim NAME=JSON`, repeatable: a claim of any value, a JSON Pointer
/// making its objects; scopes in a pointer claim (Keycloak's realm roles)
/// are an array, in `scope` a string. The token verifies and reads as the
/// gateway reads it.
#[test]
fn mint_token_writes_any_claim_and_roles_as_an_array() {
    use bloomgate::auth::jwt;
    let dir = tempdir();
    let secret = "mint-token-secret-0123456789abcdef";
    let path = write_config(
        &dir,
        &format!(
            "[auth]\nscope_claim = \"/realm_access/roles\"\n{RESOURCE}auth = \"jwt\"\n\
             owner_claim = \"tenant\"\nowner_column = \"name\"\n"
        ),
    );
    let env = [("BLOOMGATE_AUTH__JWT_SECRET", secret)];
    let (ok, out, err) = bloomgate(
        &[
            "mint-token",
            "--config",
            &path,
            "--sub",
            "7",
            "--scope",
            "orders:read admin",
            "--claim",
            "tenant=\"acme\"",
            "--claim",
            "/org/ids=[17,18]",
            "--claim",
            "email_verified=true",
        ],
        &env,
    );
    assert!(ok, "{err}");
    let claims = minted_claims(&out);
    assert_eq!(
        claims["realm_access"]["roles"],
        serde_json::json!(["orders:read", "admin"])
    );
    assert_eq!(claims["tenant"], "acme");
    assert_eq!(claims["org"]["ids"], serde_json::json!([17, 18]));
    assert_eq!(claims["email_verified"], true);
    assert_eq!(claims["sub"], "7");
    // As the gateway reads it: its roles are its scopes, its tenant the
    // owner.
    let token = out.trim();
    let parsed = jwt::parse(token.as_bytes(), 8192).unwrap();
    jwt::verify_signature(&parsed, None, Some(&jwt::Secret::new(secret.as_bytes()))).unwrap();
    let rules = jwt::Rules {
        scope_claim: "/realm_access/roles".into(),
        owner_claims: vec!["tenant".into()],
        ..jwt::Rules::default()
    };
    let now = claims["exp"].as_u64().unwrap() - 60;
    let read = jwt::claims(&parsed, &rules, now).unwrap();
    assert_eq!(read.scopes, ["orders:read", "admin"]);
    assert_eq!(read.owners, [jwt::OwnerClaim::Owner("acme".into())]);

    // `scope` itself: the space-separated string of RFC 8693.
    let plain = write_config(&dir, RESOURCE);
    let (ok, out, err) = bloomgate(
        &[
            "mint-token",
            "--config",
            &plain,
            "--sub",
            "7",
            "--scope",
            "a b",
        ],
        &env,
    );
    assert!(ok, "{err}");
    assert_eq!(minted_claims(&out)["scope"], "a b");
    // A claim replaces what the other options wrote (Keycloak's default
    // audience, to see its refusal).
    let (ok, out, _) = bloomgate(
        &[
            "mint-token",
            "--config",
            &plain,
            "--sub",
            "7",
            "--claim",
            "aud=\"account\"",
            "--claim",
            "sub=42",
        ],
        &env,
    );
    assert!(ok);
    let claims = minted_claims(&out);
    assert_eq!(
        (&claims["aud"], &claims["sub"]),
        (&serde_json::json!("account"), &serde_json::json!(42))
    );
    // A value that is not JSON: said, with how to write a string.
    let (ok, out, err) = bloomgate(
        &[
            "mint-token",
            "--config",
            &plain,
            "--sub",
            "7",
            "--claim",
            "tenant=acme",
        ],
        &env,
    );
    assert!(!ok && out.is_empty());
    assert!(
        err.contains("tenant") && err.contains("\"acme\"") && err.contains("not JSON"),
        "{err}"
    );
}

/// `"*"` in `server.cors.allow_origins` while a resource has `auth`
/// stops every command, naming the key and the resource.
#[test]
fn any_origin_with_a_private_resource_is_a_start_up_error_naming_the_key() {
    let dir = tempdir();
    let path = write_config(
        &dir,
        &format!(
            "[server.cors]\nallow_origins = [\"*\"]\n[auth]\njwt_secret = \"{}\"\n{RESOURCE}auth = \"jwt\"\n",
            "s".repeat(40)
        ),
    );
    let (ok, _, err) = bloomgate(&["check-config", "--config", &path], &[]);
    assert!(!ok);
    assert!(
        err.contains(&format!("{path}: server.cors.allow_origins: "))
            && err.contains("resource[0]"),
        "{err}"
    );
}
