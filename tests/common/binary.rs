//! The gateway's binary run as a process: its output collected line by
//! line, signals, a config file for it, and the helpers that read its log.
//! `crate::binary` of the test binary (tests/it/main.rs).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The binary, running, its stdout and stderr collected line by line.
pub struct Running {
    child: Child,
    out: Arc<Mutex<String>>,
}

impl Running {
    pub fn start(config: &std::path::Path, env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_bloomgate"));
        cmd.args(["serve", "--config"])
            .arg(config)
            .env_remove("DATABASE_URL")
            .env_remove("RUST_LOG")
            .env_remove("BLOOMGATE_ADMIN_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let out = Arc::new(Mutex::new(String::new()));
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        for pipe in [
            Box::new(stdout) as Box<dyn std::io::Read + Send>,
            Box::new(stderr),
        ] {
            let out = out.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut o = out.lock().unwrap();
                    o.push_str(&line);
                    o.push('\n');
                }
            });
        }
        Self { child, out }
    }

    pub fn log(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    /// Waits (up to 30 s: only "never" fails) until the log holds `what`.
    pub async fn wait_log(&self, what: &str) {
        let began = Instant::now();
        while !self.log().contains(what) {
            assert!(
                began.elapsed() < Duration::from_secs(30),
                "never logged {what:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The address of the listener logged as `listening` (`admin
    /// listening` for the admin one).
    pub async fn addr(&self, admin: bool) -> SocketAddr {
        let what = if admin {
            "admin listening"
        } else {
            "listening"
        };
        let began = Instant::now();
        loop {
            let log = self.log();
            for line in log.lines() {
                let is_admin = line.contains("admin listening");
                if line.contains(what)
                    && is_admin == admin
                    && let Some(a) = field(line, "addr")
                {
                    return a.parse().unwrap();
                }
            }
            assert!(
                began.elapsed() < Duration::from_secs(30),
                "never listening:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig}");
    }

    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Waits for the process to exit; its status.
    pub async fn exited(&mut self) -> std::process::ExitStatus {
        let began = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "never exited:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `key=value` of a human log line (the value up to the next space).
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    line[at..].split_whitespace().next()
}

pub const USERS: &str = r#"
[[resource]]
name = "users"
route = "/users/{id}"
table = "users"
key_column = "id"
key_type = "bigint"
columns = ["id", "name"]
"#;

pub const TOKEN_A: &str = "first-admin-token-0123456789";
pub const TOKEN_B: &str = "second-admin-token-0123456789";

/// A config file for the binary on `url`, its admin token in a file.
pub fn write_config(
    dir: &std::path::Path,
    url: &str,
    log: &str,
    token: &str,
) -> std::path::PathBuf {
    std::fs::write(dir.join("token"), token).unwrap();
    // Another loopback address: admin.listen must differ from server.listen.
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_drain = \"30s\"\n\
         [admin]\nlisten = \"127.0.0.2:0\"\ntoken_file = \"{}\"\n\
         [database]\nurl = \"{url}\"\nfreshness = \"notify\"\ninstall_triggers = true\nacquire_timeout = \"1s\"\n\
         [log]\n{log}\n{USERS}",
        dir.join("token").display()
    );
    let path = dir.join("bloomgate.toml");
    std::fs::write(&path, text).unwrap();
    path
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

pub async fn status(url: &str, token: Option<&str>) -> u16 {
    let mut req = client().get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    req.send().await.unwrap().status().as_u16()
}

/// The listener address from a JSON start-up line.
pub async fn addr_json(gw: &Running, message: &str) -> SocketAddr {
    let began = Instant::now();
    loop {
        for line in gw.log().lines() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(line)
                && v["fields"]["message"] == message
                && let Some(a) = v["fields"]["addr"].as_str()
            {
                return a.parse().unwrap();
            }
        }
        assert!(began.elapsed() < Duration::from_secs(30), "{}", gw.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `/metrics` of the admin listener at `admin` (token A).
pub async fn metrics_text(admin: SocketAddr) -> String {
    client()
        .get(format!("http://{admin}/metrics"))
        .bearer_auth(TOKEN_A)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}
